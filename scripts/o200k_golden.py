"""llama.cpp's o200k (`gpt-4o`) pre-tokenizer as a golden for moec's (issue 29), without an
o200k vocabulary (no Hub access): writes OUT_VOCAB.gguf, a vocabulary-only copy of SRC.gguf
(the tiny gpt-oss's cl100k tokens and merges) whose `tokenizer.ggml.pre` is `gpt-4o`, and
OUT.json, the ids llama.cpp (`llama_tokenize`, scripts/llama_tokenize.cpp) gives each of
TEXTS.json's texts under `gpt-4o` (that copy) and under `dbrx` (SRC.gguf itself, cl100k's
split): the texts where the two differ are the ones o200k's split rules decide.
Usage: o200k_golden.py LLAMA_TOKENIZE SRC.gguf TEXTS.json OUT_VOCAB.gguf OUT.json"""
import json
import subprocess
import sys

import gguf

tokenize, src, texts_path, out_vocab, out_json = sys.argv[1:6]
reader = gguf.GGUFReader(src)
writer = gguf.GGUFWriter(out_vocab, reader.fields["general.architecture"].contents())
for key, field in reader.fields.items():
    # Every key but the header's: llama.cpp reads the architecture's even for a vocabulary.
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    value = "gpt-4o" if key == "tokenizer.ggml.pre" else field.contents()
    kind = field.types[0]
    sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, value, kind, sub_type=sub)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()

texts = json.load(open(texts_path))["texts"]


def ids(vocab):
    stdin = b"".join(t.encode() + b"\0" for t in texts)
    run = subprocess.run([tokenize, vocab], input=stdin, capture_output=True, check=True)
    return [json.loads(line) for line in run.stdout.decode().splitlines()]


json.dump({"texts": texts, "gpt-4o": ids(out_vocab), "dbrx": ids(src)}, open(out_json, "w"))
