"""Writes a vocabulary-only copy of a GGUF file with another `tokenizer.ggml.pre`, so that
llama.cpp and moec split text by that pre-tokenizer over the same vocabulary
(scripts/gguf_fixtures.sh: cl100k's tokens and merges under o200k's `gpt-4o`, as no o200k
vocabulary is at hand offline). Usage: gguf_vocab_pre.py IN.gguf OUT.gguf PRE. Every
metadata key is copied (the architecture's too: llama.cpp reads them even for a
vocabulary), no tensor."""
import sys

import gguf

src, dst, pre = sys.argv[1:4]
reader = gguf.GGUFReader(src)
arch = reader.fields["general.architecture"].contents()
writer = gguf.GGUFWriter(dst, arch)
for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    value = pre if key == "tokenizer.ggml.pre" else field.contents()
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, value, vtype, sub_type=sub)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
