"""gen_tokenizer.py: expected ids of CLIP's tokenizer (clip_bpe_ref.py) for src/tok/bpe.c, read by
tests/test_tokenizer.c from OUTDIR/tokenizer_bpe.json.

Three vocabularies, each a list of merges "a b" (byte-level symbols, as in CLIP's merges file):
  a        MERGES_A below, the same list tests/test_tokenizer.c writes to its merges file (the C
           test checks the lists agree); well formed, so the C side uses its heap BPE
  dup      MERGES_DUP: a repeated merge result and a merge using a symbol made later, so the C
           side falls back to CLIP's literal loop
  trained  learned by clip_bpe_ref.train from TRAIN_CORPUS (vocab TRAIN_VOCAB); the C test trains
           on the same corpus and must get the same merges
and for each, captions (tricky ones and seeded random ones) with their ids, length and
normalised text at several context lengths."""
import html.entities
import json
import os
import random

from clip_bpe_ref import SimpleTokenizer, normalize, train

MERGES_A = [
    "t h", "th e</w>", "a n", "an d</w>", "o f</w>", "p h", "o t", "ph ot", "phot o</w>", "c a",
    "ca t</w>", "i t", "' s</w>", "' t</w>", "d o", "do n", "i s", "is n", "a f", "c af",
    "Ã ©</w>", "caf Ã©</w>", "n a", "Ã ¯", "na Ã¯", "v e</w>", "naÃ¯ ve</w>", "b an", "ban an",
    "banan a</w>", "a a", "aa a</w>", "aa aa", "h e", "he l", "hel l", "hell o</w>", "ä ¸",
    "ä¸ Ń", "ð Ł", "ðŁ ĺ", "2 0", "s t", "st o", "sto p</w>", "e s</w>", "r e", "x y",
]
MERGES_DUP = [
    "a b", "b c", "ab c", "a bc", "abc d</w>", "q rs", "r s", "x y", "xy z</w>", "c a", "ca b",
    "b a",
]
TRAIN_CORPUS = [
    "a photo of a red circle", "a photo of a blue square", "A PHOTO OF A GREEN TRIANGLE.",
    "a red circle on a blue background", "two red circles and a square", "the square is blue!",
    "a small green triangle, a big red circle", "circles, squares & triangles",
    "it's a photo of a cat", "don't look at the cat", "the cat's photo", "café naïve résumé",
    "photo 2023 of 12 cats", "banana bananas bandana", "aaaa aaaaa aaa", "hello world hello",
    "a photo of a dog", "a photo of the dog's ball", "red red red blue blue", "circle circle square",
]
TRAIN_VOCAB = 600

TRICKY = [
    "a photo of a cat.",
    "Don't stop! It's 2023, isn't it? They're we've I'm you'll he'd",
    "café naïve résumé CAFÉ NAÏVE",
    "emoji 😀👍🏽 and ❤️ 😀😀",
    "中文字符 日本語のテキスト 한국어",
    " ".join(["the cat sat on the mat"] * 20),
    "   extra   \t whitespace \n\n here   ",
    "Tom &amp; Jerry &lt;3 &quot;quoted&quot; &#39;single&#39; &#233;t&#xE9; &amp;amp; &amp;lt;",
    "&nbsp;nbsp&nbsp; &copy 2020 &amplifier &notit; &#128; &#0; &#x110000; &#1;x &#65 &#x41; &#;",
    "&AMP; &Eacute;cole &hellip; &apos; &bogus; & &# &#x &unknownentitynamethatislongerthanthirtytwochars;",
    "",
    "<|startoftext|>hello<|endoftext|> <|STARTOFTEXT|> <|endoftext|>x",
    "İstanbul ΑΘΗΝΑ Москва ĞÜŞÇÖ ẞ ＡＢＣ",
    "it'ſ it'S IT'LL",
    "aaaaa banana bananas aaaaaaaaa",
    "x\u00a0y\u2003z\u3000w \x1c q\u0085r \u2028s",
    "rock'n'roll 'quoted' '' '''s",
    "3.14159 1,000,000 ½ ² ٣ ⅻ",
    "hello\u200bworld zero\u200dwidth",
    "UPPER lower MiXeD",
    "don’t “curly” — dash",
    "tab\tand\r\nnewline\x0bvt\x0cff",
    "....!!!???,,,;;; --- ***",
    "the the the, the.",
    "ᾳͅ ab\u0345cd -\u180e- x\u180ey \u0345",  # regex drops U+0345; U+180E is no space for it
    # scripts the hand-written ranges missed (utf8proc now): Armenian, Cherokee, Georgian, Deseret,
    # title case, Ohm / Kelvin / Angstrom signs, Glagolitic, Adlam
    "ՀԱՅԱՍՏԱՆ Երևան ᎠᎡᎢ ႠႡႢ 𐐀𐐁 ǅǈ Ω K Å ⰀⰁ 𞤀𞤁",
    # final sigma: word ends, before punctuation and apostrophes, alone, between letters, with
    # combining marks and after a digit
    "ΟΔΟΣ ΟΔΟΣ. ΟΔΟΣ'Α Σ ΑΣΑ ΑΣ\u0301 ΑΣ\u0301Β 1Σ ΑΣ1 ΑΣ'",
]


def lower_coverage():
    """Every upper-case code point in the ranges src/tok/bpe.c lowers (see tok.h)."""
    ranges = [(0x41, 0x17F), (0x386, 0x3AB), (0x400, 0x42F), (0x1E00, 0x1EFF), (0xFF21, 0xFF3A)]
    cs = [chr(c) for a, b in ranges for c in range(a, b + 1)
          if chr(c).lower() != chr(c) and c != 0x3A3]  # final sigma is not context-aware in C
    return " ".join("".join(cs[i:i + 20]) for i in range(0, len(cs), 20))


def entity_coverage():
    """Every named reference src/tok/bpe.c knows, with ';' and without (the legacy rule)."""
    names = sorted(set(html.entities.name2codepoint) | {"apos", "AMP", "COPY", "GT", "LT", "QUOT", "REG"})
    return " ".join(f"&{n}; &{n}x" for n in names)


def random_captions(seed, n):
    rng = random.Random(seed)
    alphabet = list("abcdefhinoprstxyz") + ["é", "ï", " ", " ", "'", "2", "0", ".", "中", "😀",
                                           "&amp;", "A", "É", "'s", "\t", "aa"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def cases(name, tok, texts, ctxs):
    out = []
    for t in texts:
        for ctx in ctxs:
            ids, n = tok.tokenize(t, ctx)
            out.append({"tok": name, "text": t, "ctx": ctx, "ids": ids, "len": n, "normalized": normalize(t)})
    return out


def generate(outdir):
    a = SimpleTokenizer([m.split() for m in MERGES_A])
    dup = SimpleTokenizer([m.split() for m in MERGES_DUP])
    trained_merges = train(TRAIN_CORPUS, TRAIN_VOCAB)
    trained = SimpleTokenizer(trained_merges)
    tricky = TRICKY + [lower_coverage(), entity_coverage()]
    dup_words = ["abcd", "abc", "qrs", "bcabc", "abab", "xyz", "cabcab", "bab", "abcabcd", "aabbcc"]
    all_cases = (cases("a", a, tricky, [77, 16, 2]) + cases("a", a, random_captions(1, 60), [77]) +
                 cases("dup", dup, dup_words + random_captions(2, 30), [77]) +
                 cases("trained", trained, tricky + TRAIN_CORPUS + random_captions(3, 30), [77]))
    fixture = {
        "merges_a": MERGES_A,
        "merges_dup": MERGES_DUP,
        "train": {"corpus": TRAIN_CORPUS, "vocab_size": TRAIN_VOCAB,
                  "merges": [f"{x} {y}" for x, y in trained_merges]},
        "cases": all_cases,
    }
    with open(os.path.join(outdir, "tokenizer_bpe.json"), "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    import sys
    generate(sys.argv[1] if len(sys.argv) > 1 else ".")
