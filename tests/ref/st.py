"""st.py: a minimal safetensors writer/reader for the fixture generators (Debian has no
python3-safetensors). Same layout as the format: u64 little-endian header length, JSON header,
raw little-endian data."""
import json
import struct

import numpy as np

_DT = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
       np.dtype("int32"): "I32", np.dtype("int64"): "I64", np.dtype("uint8"): "U8"}
_NP = {v: k for k, v in _DT.items()}


def save(path, tensors, metadata=None):
    """tensors: dict name -> numpy array (or torch tensor); written in sorted-name order."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        if hasattr(a, "detach"):
            a = a.detach().cpu().numpy()
        a = np.asarray(a)  # not ascontiguousarray: it turns a 0-d scalar into shape [1]
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.dtype not in _DT:
            raise ValueError(f"{name}: unsupported dtype {a.dtype}")
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _DT[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, d in header.items():
        a, b = d["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=_NP[d["dtype"]]).reshape(d["shape"])
    return out, meta
