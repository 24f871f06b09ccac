"""gen_lower.py: Python's str.lower() of every code point it changes (CPython's Unicode tables, here
Unicode 14 in Debian's python3.11), for tests/test_tokenizer.c, which checks src/tok/bpe.c's
lower-casing (libutf8proc) against it on all 0x110000 code points: OUTDIR/lower_table.json is
{"unicode": version, "lower": {"cp": [cp, ...]}, "unassigned": [[lo, hi], ...]}; unassigned lists
the ranges Python's tables call Cn, which a newer libutf8proc may know (reported, not compared)."""
import json
import os
import unicodedata


def generate(outdir):
    lower, unassigned, lo = {}, [], None
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        ch = chr(c)
        low = ch.lower()
        if low != ch:
            lower[str(c)] = [ord(x) for x in low]
        cn = unicodedata.category(ch) == "Cn"
        if cn and lo is None:
            lo = c
        if not cn and lo is not None:
            unassigned.append([lo, c - 1])
            lo = None
    if lo is not None:
        unassigned.append([lo, 0x10FFFF])
    with open(os.path.join(outdir, "lower_table.json"), "w") as f:
        json.dump({"unicode": unicodedata.unidata_version, "lower": lower, "unassigned": unassigned}, f)


if __name__ == "__main__":
    import sys
    generate(sys.argv[1] if len(sys.argv) > 1 else ".")
