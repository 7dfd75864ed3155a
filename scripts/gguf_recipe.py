"""A recipe that rebuilds a GGUF file llama.cpp's tools made from a GGUF moec made of the same
checkpoint, so the repository can hold llama.cpp's fixtures without their bytes.

The family fixtures' vocabulary is 100352 rows (cl100k), so each file is 34-238 MB, most of
it the embedding and output matrices: too large to commit. `moec quantize` writes the same
tensors with the same bytes (tests/cli_generate.rs asserts it tensor by tensor); the files
differ in metadata the converter derives (`general.name`, `tokenizer.ggml.pre`, ...) and
may differ in key and tensor order. A recipe holds llama.cpp's own header with each large
key/value pair that moec's file has byte for byte replaced by a reference to it, and says
the tensor data is the source's tensors by name at llama.cpp's offsets.
tests/gguf_common/mod.rs follows it and checks the result against tests/fixtures/gguf/
SHA256SUMS*, so the file the tests read is llama.cpp's to the byte or the test fails.

Usage: gguf_recipe.py LLAMA.gguf SOURCE.gguf SOURCE_JSON OUT.json
  SOURCE_JSON says how the rebuilder makes SOURCE.gguf (see tests/fixtures/gguf/recipes/
  README.md): {"synth": RON, "mxfp4": bool, "quantize": [flags]} or {"file": NAME}.
Writes OUT.json after rebuilding LLAMA.gguf from it in Python and comparing the bytes."""
import json
import struct
import sys

# ggml type -> (weights per block, bytes per block), for the tensors these fixtures hold.
TYPE_SIZE = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144),
             13: (256, 176), 14: (256, 210), 30: (1, 2), 39: (32, 17)}
# GGUF scalar value type -> size in bytes (8 = string, 9 = array are variable).
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# A key/value pair at least this long is referenced rather than copied when the source has it.
MIN_REFERENCED = 256


class Gguf:
    """The header of a GGUF file: each key/value pair's raw bytes, the tensor infos, where
    the data starts."""

    def __init__(self, data):
        self.data = data
        self.pos = 0
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        assert magic == b"GGUF" and version == 3, (magic, version)
        self.pos = 24
        self.kv = []  # (key, start, end)
        alignment = 32
        for _ in range(n_kv):
            start = self.pos
            key = self.string()
            kind = self.u32()
            if key == "general.alignment":
                assert kind == 4
                alignment = struct.unpack_from("<I", data, self.pos)[0]
            self.value(kind)
            self.kv.append((key, start, self.pos))
        self.kv_end = self.pos
        self.tensors = []  # (name, dims, type, offset)
        for _ in range(n_tensors):
            name = self.string()
            dims = [self.u64() for _ in range(self.u32())]
            kind = self.u32()
            self.tensors.append((name, dims, kind, self.u64()))
        self.header_end = self.pos
        self.data_start = -(-self.pos // alignment) * alignment

    def u32(self):
        self.pos += 4
        return struct.unpack_from("<I", self.data, self.pos - 4)[0]

    def u64(self):
        self.pos += 8
        return struct.unpack_from("<Q", self.data, self.pos - 8)[0]

    def string(self):
        n = self.u64()
        self.pos += n
        return self.data[self.pos - n:self.pos].decode()

    def value(self, kind):
        if kind == 8:
            self.string()
        elif kind == 9:
            sub, count = self.u32(), self.u64()
            for _ in range(count):
                self.value(sub)
        else:
            self.pos += SCALAR[kind]

    def kv_bytes(self):
        return {key: self.data[s:e] for key, s, e in self.kv}

    def tensor_bytes(self, name):
        for n, dims, kind, offset in self.tensors:
            if n == name:
                block, size = TYPE_SIZE[kind]
                count = 1
                for d in dims:
                    count *= d
                assert count % block == 0, name
                start = self.data_start + offset
                return (dims, kind), self.data[start:start + count // block * size]
        raise KeyError(name)


def recipe(llama, source):
    """Header pieces: hex strings of llama.cpp's bytes, or {"kv": KEY} for a pair the source
    holds byte for byte."""
    theirs = source.kv_bytes()
    pieces, literal = [], bytearray(llama.data[:24])
    for key, s, e in llama.kv:
        raw = llama.data[s:e]
        if len(raw) >= MIN_REFERENCED and theirs.get(key) == raw:
            if literal:
                pieces.append(literal.hex())
            pieces.append({"kv": key})
            literal = bytearray()
        else:
            literal += raw
    literal += llama.data[llama.kv_end:llama.header_end]
    pieces.append(literal.hex())
    return pieces


def rebuild(pieces, source, size):
    """What tests/gguf_common/mod.rs does with a recipe."""
    kv = source.kv_bytes()
    header = b"".join(bytes.fromhex(p) if isinstance(p, str) else kv[p["kv"]] for p in pieces)
    out = bytearray(header)
    parsed = Gguf(header + b"\0" * 64)
    for name, dims, kind, offset in sorted(parsed.tensors, key=lambda t: t[3]):
        shape, data = source.tensor_bytes(name)
        assert shape == (dims, kind), (name, shape, dims, kind)
        out += b"\0" * (parsed.data_start + offset - len(out))
        out += data
    out += b"\0" * (size - len(out))
    return bytes(out)


def main():
    llama_path, source_path, source_json, out_path = sys.argv[1:5]
    llama = Gguf(open(llama_path, "rb").read())
    source = Gguf(open(source_path, "rb").read())
    pieces = recipe(llama, source)
    rebuilt = rebuild(pieces, source, len(llama.data))
    if rebuilt != llama.data:
        first = next(i for i, (a, b) in enumerate(zip(rebuilt, llama.data)) if a != b)
        sys.exit(f"{llama_path}: the rebuilt file differs from byte {first}")
    doc = {
        "file": llama_path.rsplit("/", 1)[-1],
        "size": len(llama.data),
        "source": json.loads(source_json),
        "header": pieces,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
