"""The EOS and BOS a build adds around every document, from the options and the tokenizer's own tokens."""

from __future__ import annotations

from streampack._checks import check_int
from streampack.errors import TokenizerError
from streampack.format.sections import BosPolicy, EosPolicy  # the manifest's sections, what a build decides
from streampack.tokenizer.base import Tokenizer

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


def resolve_bos(tokenizer: Tokenizer, *, bos: bool, bos_id: int | None) -> BosPolicy:
    """Decide the BOS policy: ``bos_id`` when given, else with ``bos`` the tokenizer's own BOS token (tiktoken
    and ``bytes`` tokenizers have none).

    Raises:
        TokenizerError: BOS is wanted but neither given nor known to the tokenizer.
    """
    if not bos and bos_id is None:
        return BosPolicy(False, None)
    if bos_id is not None:
        return BosPolicy(True, bos_id)
    if tokenizer.bos_id is None:
        raise TokenizerError(
            f"tokenizer {tokenizer.spec!r} has no BOS token that streampack recognises (looked for the "
            f"bos_token of a tokenizer_config.json beside a tokenizer.json, and {', '.join(BOS_NAMES)}); "
            "pass bos_id=N"
        )
    return BosPolicy(True, tokenizer.bos_id)


def resolve_eos(tokenizer: Tokenizer, *, eos: bool, eos_id: int | None) -> EosPolicy:
    """Decide the EOS policy from the options and the tokenizer's own EOS token.

    Raises:
        TokenizerError: EOS is wanted but neither given nor known to the tokenizer.
    """
    if not eos:
        return EosPolicy(False, None)
    if eos_id is not None:
        return EosPolicy(True, check_int("eos_id", eos_id, min=0, below=2**32))
    if tokenizer.eos_id is None:
        raise TokenizerError(
            f"tokenizer {tokenizer.spec!r} has no EOS token that streampack recognises "
            f"(looked for {', '.join(EOS_NAMES)}); pass eos_id=N, or eos=False to append none"
        )
    return EosPolicy(True, tokenizer.eos_id)
