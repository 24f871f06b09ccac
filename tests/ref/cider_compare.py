"""cider_compare.py: vlmoe_cider_d (libvlmoe.so, through ctypes) against pycocoevalcap's CIDEr-D
on random captions over a small vocabulary (many shared n-grams, repeated words, lengths 0..12).
Optional, not part of `make test`: needs `pip install pycocoevalcap`.
usage: python3 tests/ref/cider_compare.py [libvlmoe.so] [images] [refs per image]"""
import ctypes
import random
import sys

from pycocoevalcap.cider.cider import Cider


def main():
    lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "./libvlmoe.so")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    rng = random.Random(7)
    words = "a an the red green blue small big cat dog ball cube on under near sits runs".split()
    cap = lambda lo: " ".join(rng.choice(words) for _ in range(rng.randint(lo, 12)))
    cands = [cap(0) for _ in range(n)]
    refs = [[cap(1) for _ in range(rng.randint(1, k))] for _ in range(n)]
    gts = {i: refs[i] for i in range(n)}
    res = {i: [cands[i]] for i in range(n)}
    want, want_per = Cider().compute_score(gts, res)

    flat = [r for rs in refs for r in rs]
    off = [0]
    for rs in refs:
        off.append(off[-1] + len(rs))
    C = (ctypes.c_char_p * n)(*[c.encode() for c in cands])
    R = (ctypes.c_char_p * len(flat))(*[r.encode() for r in flat])
    O = (ctypes.c_int * (n + 1))(*off)
    score, per = ctypes.c_double(), (ctypes.c_double * n)()
    lib.vlmoe_cider_d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_double), ctypes.c_void_p]
    if lib.vlmoe_cider_d(C, n, R, O, ctypes.byref(score), per) != 0:
        sys.exit("vlmoe_cider_d failed")
    worst = max(abs(per[i] - want_per[i]) for i in range(n))
    print(f"{n} images, {len(flat)} references: pycocoevalcap CIDEr-D {want:.12f}, vlmoe {score.value:.12f}, "
          f"worst per-image difference {worst:.3g}")
    sys.exit(0 if abs(want - score.value) < 1e-9 and worst < 1e-9 else 1)


if __name__ == "__main__":
    main()
