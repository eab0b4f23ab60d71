"""Tokenizers: the project's own byte-level BPE (shipped as assets/tokenizer.json) or a local HF one.

Both are exposed as a transformers ``PreTrainedTokenizerFast``, so the rest of the app sees one type.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

EMBEDDED_VOCAB = 2048
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>"]
TOKENIZER_MODULE = "transformers.tokenization_utils_tokenizers"  # PreTrainedTokenizerFast's (~1 s to import)
AUTO_TOKENIZER_MODULE = "transformers.models.auto.tokenization_auto"  # AutoTokenizer's: it scans every model


def tokenizer_modules(path: str | None) -> list[str]:
    """What :func:`load_tokenizer` imports for ``path``: a launcher's workers can have it preloaded."""
    return [TOKENIZER_MODULE] if path is None else [TOKENIZER_MODULE, AUTO_TOKENIZER_MODULE]


def embedded_tokenizer_path() -> Path:
    return Path(str(resources.files("deepshard.finetune") / "assets" / "tokenizer.json"))


def train_embedded_tokenizer(out: Path, vocab_size: int = EMBEDDED_VOCAB) -> None:
    """Rebuild assets/tokenizer.json from the embedded corpus (run once; the file is committed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from deepshard.finetune.data.corpus import generate

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generate(20000, seed=12345), trainer=trainer)
    tok.save(str(out))


def load_tokenizer(path: str | None = None):
    """A local HF tokenizer directory (``model.path``), or the embedded one when ``path`` is None."""
    if path is None:  # with the small chat template shipped beside it (data=chat); not AutoTokenizer here:
        from transformers import PreTrainedTokenizerFast  # its import scans every model (~1 s)

        from deepshard.finetune.data.chat import embedded_chat_template

        return PreTrainedTokenizerFast(tokenizer_file=str(embedded_tokenizer_path()), pad_token="<|pad|>",
                                       bos_token="<|bos|>", eos_token="<|eos|>",
                                       chat_template=embedded_chat_template())
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ValueError(f"model.path={path!r}: not a directory holding a HF tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...
        raise ValueError(f"model.path={path!r}: its tokenizer does not load ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]})") from None
    if tok.eos_token_id is None:
        raise ValueError(f"model.path={path!r}: the tokenizer defines no eos token, needed to separate documents")
    if not tok.chat_template:  # a checkpoint without one (base models): its family's, saved with the run's checkpoints
        from deepshard.finetune.data.chat import family_chat_template

        if (default := family_chat_template(path)) is not None:
            tok.chat_template = default[1]
    return tok


if __name__ == "__main__":
    train_embedded_tokenizer(embedded_tokenizer_path())
    print("wrote", embedded_tokenizer_path())
