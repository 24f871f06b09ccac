"""clip_bpe_ref.py: reference of CLIP's tokenizer, written from OpenAI CLIP's published
simple_tokenizer.py (bytes_to_unicode, get_pairs, basic_clean, whitespace_clean, bpe, encode),
with OpenCLIP's truncation, for src/tok/bpe.c; used by gen_tokenizer.py for tests/test_tokenizer.c.

Differences from the original, on purpose: ftfy.fix_text is not applied (vlmoe does not implement
it: see src/tok/tok.h), merges come from a list or a file of any length (CLIP's slice [1:48895]
is kept), and `train` is a plain reference of the BPE training vlmoe implements (most frequent
pair, ties to the smallest (left, right) strings)."""
import gzip
import html

import regex as re

PATTERN = re.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    re.IGNORECASE)
SOT, EOT = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b)
            cs.append(2 ** 8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def get_pairs(word):
    return set(zip(word[:-1], word[1:]))


def basic_clean(text):
    text = html.unescape(html.unescape(text))  # CLIP runs ftfy.fix_text first
    return text.strip()


def whitespace_clean(text):
    text = re.sub(r"\s+", " ", text)
    return text.strip()


def normalize(text):
    return whitespace_clean(basic_clean(text)).lower()


def pretokenize(text):
    return re.findall(PATTERN, normalize(text))


def read_merges(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        lines = f.read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    while lines and not lines[-1].strip():  # the newline ending the file
        lines.pop()
    return [tuple(m.split()) for m in lines]


class SimpleTokenizer:
    def __init__(self, merges):
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        merges = [tuple(m) for m in merges]
        vocab = list(self.byte_encoder.values())
        vocab = vocab + [v + "</w>" for v in vocab]
        for merge in merges:
            vocab.append("".join(merge))
        vocab.extend([SOT, EOT])
        self.vocab = vocab
        self.encoder = dict(zip(vocab, range(len(vocab))))
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks = dict(zip(merges, range(len(merges))))
        self.cache = {SOT: SOT, EOT: EOT}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        pairs = get_pairs(word)
        if not pairs:
            return token + "</w>"
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                    new_word.extend(word[i:j])
                    i = j
                except ValueError:
                    new_word.extend(word[i:])
                    break
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        word = " ".join(word)
        self.cache[token] = word
        return word

    def encode(self, text):
        bpe_tokens = []
        for token in pretokenize(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            bpe_tokens.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return bpe_tokens

    def tokenize(self, text, context_length=77):
        """OpenCLIP: [SOT] + ids + [EOT], truncated keeping EOT last, 0-padded. Returns
        (ids, length before padding)."""
        tokens = [self.encoder[SOT]] + self.encode(text) + [self.encoder[EOT]]
        if len(tokens) > context_length:
            tokens = tokens[:context_length]
            tokens[-1] = self.encoder[EOT]
        n = len(tokens)
        return tokens + [0] * (context_length - n), n


def train(texts, vocab_size):
    """BPE training as vlmoe does it: word counts after CLIP's pre-tokenization, then the most
    frequent adjacent pair (ties: smallest (left, right) strings) merged everywhere, until
    512 + merges + 2 == vocab_size or no pair is left. Returns the merges [(a, b), ...]."""
    enc = bytes_to_unicode()
    counts = {}
    for t in texts:
        for tok in pretokenize(t):
            if tok in (SOT, EOT):
                continue
            counts[tok] = counts.get(tok, 0) + 1
    words = []
    for tok, c in counts.items():
        syms = [enc[b] for b in tok.encode("utf-8")]
        syms[-1] += "</w>"
        words.append([syms, c])
    merges = []
    while len(merges) < vocab_size - 512 - 2:
        pairs = {}
        for syms, c in words:
            for p in zip(syms[:-1], syms[1:]):
                pairs[p] = pairs.get(p, 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        a, b = best
        for w in words:
            syms, out, i = w[0], [], 0
            while i < len(syms):
                if syms[i] == a and i + 1 < len(syms) and syms[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            w[0] = out
    return merges
