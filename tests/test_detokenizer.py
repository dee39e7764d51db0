"""Incremental detokenization against full decoding, on tokenizers trained here (byte-level BPE,
SentencePiece-style Unigram, byte-fallback BPE) and on the default model's Qwen tokenizer."""

import json
import random

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from candelabra.core.engine.detokenizer import IncrementalDetokenizer
from candelabra.core.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "Grüße aus München: naïve café, crème brûlée, façade, señor.",
    "日本語のテキストです。中文文本也在这里。",
    "한국어 텍스트도 있습니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 and more 😀🎉.",
] * 10
MULTILINGUAL = [
    "Hello, world!",
    "Grüße aus München, naïve café",
    "日本語のテキスト、中文。",
    "한국어 텍스트",
    "Emoji 😀🎉👍🏽 👨‍👩‍👧 🇫🇷",
    "rare: 龘 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦀 x² ∑ — ✓",
    "  leading and  double  spaces ",
    "\nnew\nlines\n",
]


def wrap(raw: RawTokenizer) -> Tokenizer:
    raw.add_special_tokens(SPECIAL_TOKENS)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                             eos_token="</s>"))


def byte_level_bpe() -> Tokenizer:
    """GPT-2 / Qwen style: every byte is a symbol, so characters can split across tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIAL_TOKENS,
        show_progress=False))
    return wrap(raw)


def metaspace_unigram() -> Tokenizer:
    """SentencePiece style: words start with "▁", which the decoder drops from the first token."""
    raw = RawTokenizer(models.Unigram())
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, unk_token="<unk>", show_progress=False))
    return wrap(raw)


def byte_fallback_bpe() -> Tokenizer:
    """Llama / Gemma style: characters outside the vocabulary become <0xNN> byte tokens; the
    decoder strips one leading space from the whole text."""
    trained = RawTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS[:2], trainers.BpeTrainer(
        vocab_size=200, special_tokens=SPECIAL_TOKENS, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) for merge in model["merges"]]
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return wrap(raw)


BUILDERS = {"byte_level_bpe": byte_level_bpe, "metaspace_unigram": metaspace_unigram,
            "byte_fallback_bpe": byte_fallback_bpe}
# Decoders that drop the space of a text's first word: a continuation of a prompt keeps it.
DROPS_FIRST_SPACE = {"metaspace_unigram", "byte_fallback_bpe"}


@pytest.fixture(scope="module", params=list(BUILDERS))
def named_tokenizer(request):
    return request.param, BUILDERS[request.param]()


@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe()


def stream(tokenizer, prompt, generated, skip_special_tokens=True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add(token) for token in generated]
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas


def assert_matches_full_decode(name, tokenizer, prompt, generated, skip_special_tokens=True):
    deltas = stream(tokenizer, prompt, generated, skip_special_tokens)
    full = tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)
    streamed = "".join(deltas)
    if prompt and name in DROPS_FIRST_SPACE:
        assert streamed in (full, " " + full)
    else:
        assert streamed == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in delta for delta in deltas), deltas
    return deltas


@pytest.mark.parametrize("text", MULTILINGUAL)
@pytest.mark.parametrize("prompt_text", ["", "Translate: "])
def test_encoded_text_streams_back_whole(named_tokenizer, text, prompt_text):
    name, tokenizer = named_tokenizer
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    generated = tokenizer.encode(text, add_special_tokens=False)
    deltas = assert_matches_full_decode(name, tokenizer, prompt, generated)
    assert "".join(deltas).strip() == tokenizer.decode(generated).strip()


def byte_fallback_ids(tokenizer) -> dict[int, int]:
    """Byte value by token id, for the <0xNN> tokens of a byte-fallback vocabulary."""
    vocab = tokenizer._hf.get_vocab()
    return {vocab[f"<0x{byte:02X}>"]: byte for byte in range(256) if f"<0x{byte:02X}>" in vocab}


def random_generations(tokenizer, rng, count):
    """Random prompts and outputs, special tokens frequent. Byte-fallback tokens come only as
    whole characters: see test_byte_fallback_shows_valid_bytes_that_a_later_invalid_byte_spoils."""
    special = tokenizer.encode("".join(SPECIAL_TOKENS), add_special_tokens=False)
    byte_tokens = byte_fallback_ids(tokenizer)
    token_by_byte = {byte: token for token, byte in byte_tokens.items()}
    ordinary = [token for token in range(tokenizer.vocab_size) if token not in byte_tokens]

    def some_tokens():
        tokens = []
        for _ in range(rng.randrange(0, 12)):
            if rng.random() < 0.1:
                tokens.append(rng.choice(special))
            elif byte_tokens and rng.random() < 0.3:
                character = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0xA000),
                                            rng.randrange(0x1F300, 0x1FA00)]))
                tokens += [token_by_byte[byte] for byte in character.encode()]
            else:
                tokens.append(rng.choice(ordinary))
        return tokens

    return [(some_tokens(), some_tokens()) for _ in range(count)]


def test_random_token_sequences_match_full_decode(named_tokenizer):
    name, tokenizer = named_tokenizer
    rng = random.Random(1234)
    for prompt, generated in random_generations(tokenizer, rng, 600):
        assert_matches_full_decode(name, tokenizer, prompt, generated, skip_special_tokens=rng.random() < 0.5)


def test_byte_fallback_shows_valid_bytes_that_a_later_invalid_byte_spoils():
    """A byte-fallback decoder turns a whole run of byte tokens into replacement characters when
    any of them is invalid, valid ones included. A stream cannot take back what it showed."""
    tokenizer = byte_fallback_bpe()
    token_by_byte = {byte: token for token, byte in byte_fallback_ids(tokenizer).items()}
    generated = tokenizer.encode("ok", add_special_tokens=False) + [token_by_byte[0x70], token_by_byte[0xC8]]
    generated += tokenizer.encode("then", add_special_tokens=False)  # "▁then"
    assert tokenizer.decode(generated) == "ok\ufffd\ufffd then"
    assert "".join(stream(tokenizer, [], generated)) == "okp\ufffd then"


def test_continuation_keeps_the_space_a_sentencepiece_decoder_drops_at_the_start():
    tokenizer = metaspace_unigram()
    prompt = tokenizer.encode("Grüße aus", add_special_tokens=False)
    generated = tokenizer.encode("München, naïve café", add_special_tokens=False)
    assert tokenizer.decode(generated) == "München, naïve café"
    assert "".join(stream(tokenizer, prompt, generated)) == " München, naïve café"
    assert "".join(stream(tokenizer, [], generated)) == "München, naïve café"


def test_a_character_split_across_tokens_comes_out_whole_with_its_last_byte(bpe):
    generated = bpe.encode("a龘b", add_special_tokens=False)
    pieces = [bpe.decode([token]) for token in generated]
    assert REPLACEMENT in "".join(pieces), "the test needs 龘 split into byte tokens"
    deltas = stream(bpe, [], generated)
    assert "龘" in deltas and "" in deltas
    assert "".join(deltas) == "a龘b"


def test_flush_gives_an_unfinished_character_as_decoding_shows_it(bpe):
    generated = bpe.encode("ok 龘", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(bpe, [])
    streamed = "".join(detokenizer.add(token) for token in generated)
    assert REPLACEMENT not in streamed
    tail = detokenizer.flush()
    assert tail.endswith(REPLACEMENT) and streamed + tail == bpe.decode(generated)
    assert detokenizer.flush() == ""


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(bpe):
    ids = bpe.encode("x 龘", add_special_tokens=False)
    prompt, generated = ids[:-1], ids[-1:]
    assert bpe.decode(prompt).endswith(REPLACEMENT)
    assert "".join(stream(bpe, prompt, generated)) == bpe.decode(generated)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(named_tokenizer, skip):
    name, tokenizer = named_tokenizer
    eos = tokenizer.encode("</s>", add_special_tokens=False)
    assert len(eos) == 1
    generated = tokenizer.encode("Hello world", add_special_tokens=False) + eos + eos
    generated += tokenizer.encode(" café 😀", add_special_tokens=False)
    deltas = assert_matches_full_decode(name, tokenizer, [], generated, skip_special_tokens=skip)
    assert ("</s>" in "".join(deltas)) is not skip


class DecodeSpy(Tokenizer):
    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer._hf)
        self.longest = 0

    def decode(self, token_ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(token_ids))
        return super().decode(token_ids, skip_special_tokens)


def test_the_decoded_window_does_not_grow_with_the_output(bpe):
    eos = bpe.encode("</s>", add_special_tokens=False)
    prompt = bpe.encode("A long prompt " * 20, add_special_tokens=False)
    # Skipped special tokens decode to nothing, so a run of them must not widen the window either.
    once = bpe.encode(" ".join(MULTILINGUAL), add_special_tokens=False) + eos * 50

    def longest_window(generated):
        spy = DecodeSpy(bpe)
        assert "".join(stream(spy, prompt, generated)) == bpe.decode(generated)
        return spy.longest

    assert longest_window(once * 20) == longest_window(once) < 16


@pytest.fixture(scope="module")
def qwen():
    from candelabra.core.weights.default_model import default_model_path
    from candelabra.core.weights.gguf import GGUFCheckpoint

    # The README's set-up installs the default model (the demo extra); without it this fails
    # with the install command.
    return Tokenizer.from_checkpoint(GGUFCheckpoint(default_model_path()))


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_qwen_tokenizer_streams_multilingual_text_and_emoji(qwen, skip):
    prompt = qwen.chat_token_ids([{"role": "user", "content": "Say something in many languages."}])
    end = qwen.encode("<|im_end|>", add_special_tokens=False)
    for text in MULTILINGUAL:
        generated = qwen.encode(text, add_special_tokens=False) + end
        deltas = assert_matches_full_decode("qwen", qwen, prompt, generated, skip_special_tokens=skip)
        assert "".join(deltas) == text + ("" if skip else "<|im_end|>")
    rng = random.Random(7)
    for _ in range(100):
        generated = [rng.randrange(qwen.vocab_size) for _ in range(rng.randrange(1, 24))]
        assert_matches_full_decode("qwen", qwen, prompt, generated, skip_special_tokens=skip)


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_calls_the_rust_tokenizer_only_where_it_says_what_transformers_says(named_tokenizer, clean_up):
    """Tokenizer.decode skips transformers' Python wrapper, except where the wrapper cleans up spaces."""
    name, tokenizer = named_tokenizer
    hf = tokenizer.hf_tokenizer
    original, hf.clean_up_tokenization_spaces = hf.clean_up_tokenization_spaces, clean_up
    try:
        wrapped = Tokenizer(hf)
        assert (wrapped._rust_decode is None) == clean_up
        rng = random.Random(99)
        texts = MULTILINGUAL + ["a , b . c ! d ? e n't it 's"]
        for _ in range(200):
            ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(0, 20))]
            ids += hf.encode(rng.choice(texts), add_special_tokens=False)
            for skip in (True, False):
                assert wrapped.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    finally:
        hf.clean_up_tokenization_spaces = original
