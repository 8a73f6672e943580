"""RankGrammars: one rank's grammar compiler, with the tokenizer loaded on the first grammar."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_tokenizer

from engines.decoding.grammar import GrammarCompiler, LogitsProcessor
from errors import EngineError

log = logging.getLogger(__name__)


class RankGrammars:
    """Every rank applies the same grammar processor, so every rank needs the tokenizer.

    A rank loads only the weights (mlx-lm's `load_model`); the tokenizer is loaded on the
    first sequence with a grammar and kept, so a group that never sees one never pays for it.
    `vocab_size` is the model's (`model.args.vocab_size`): the compiler covers the larger of it
    and the tokenizer's, as the single engine's does, so both mask the same tokens.
    """

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: Any = None) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids  # config.json's eos_token_id, as the engine's
        self._compiler: GrammarCompiler | None = None

    def processor(self, grammar: str) -> LogitsProcessor:
        """A fresh logits processor for one sequence; EngineError if the grammar is invalid or
        the tokenizer cannot be loaded."""
        return self._grammar_compiler().processor(grammar)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            try:
                tokenizer = load_tokenizer(self.model_path, eos_token_ids=self.eos_token_ids)
            except Exception as error:  # transformers raises many kinds; all mean "no tokenizer"
                raise EngineError(
                    f"cannot load the tokenizer of {self.model_path} for a grammar: {error}"
                ) from error
            vocab_size = max(self.vocab_size, len(tokenizer))
            self._compiler = GrammarCompiler(tokenizer, vocab_size)
            log.info("loaded the tokenizer for grammars (%d tokens)", vocab_size)
        return self._compiler
