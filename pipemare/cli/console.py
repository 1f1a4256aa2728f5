"""What the project's commands print: Lightning's progress bar, pipemare's own lines and real
problems, not the chatter a user did nothing to cause.

:func:`quiet` is called once by every ``pipemare`` command (and again in each process a
multi-process run launches, since those re-run the command). It drops, by their exact text:

- Lightning's informational lines that say nothing about this run's setup ("GPU available",
  "TPU available", "Seed set to", advertisements for other Lightning products, the note that
  it loads the train loader to count steps, the banner of a multi-process start, which the
  strategy's own layout line replaces);
- the ``LeafSpec`` deprecation that Lightning's pytree helpers raise under torch >= 2.10 (a
  matter between Lightning and torch);
- W&B's banner (run with ``WANDB_SILENT=false`` to see it); the logger prints one line of its
  own saying where the run is and how to upload it.

Everything else, including every warning Lightning, torch or pipemare raise about the run
itself, is left as it is. A library user's own ``Trainer`` is untouched: this runs only in the
commands.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["NOISE", "quiet"]

#: the starts of the informational lines dropped from Lightning's loggers
NOISE = (
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "Seed set to",
    "💡 Tip:",
    "Loading `train_dataloader` to estimate number of stepping batches",
    "Initializing distributed:",
    "-" * 40,  # the banner of a multi-process start; pipemare prints its own layout
)

_LOGGERS = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        message = str(record.getMessage())
        if message.startswith("[rank: "):  # a rank-prefixed message: its text after "] "
            message = message.split("] ", 1)[-1]
        return not message.startswith(NOISE)


_FILTER = _DropNoise()


def quiet() -> None:
    """Silence the known chatter (see the module); safe to call more than once."""
    import pipemare  # noqa: F401 - imports Lightning, which sets up the loggers filtered here

    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    os.environ.setdefault("WANDB_SILENT", "true")
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        # the records of child loggers reach these handlers without the logger's own filters
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
