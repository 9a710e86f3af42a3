"""The schedule IR's unit, the action (``schedule.py`` holds the per-rank lists of them).

An action is (stage index, kind, microbatch). Its text form is
``{stage}{kind}{microbatch}`` -- ``3F0``, ``1SEND_B2``, ``0W5`` -- the form
torch.distributed.pipelining prints and parses (``_Action.__repr__`` /
``_Action.from_str``), so a schedule written here as CSV loads there unchanged.

Conventions shared with torch.distributed.pipelining:
- ``SEND_F`` carries the *sender's* stage, ``RECV_F`` the *receiver's*:
  ``2SEND_F0`` on the rank of stage 2 matches ``3RECV_F0`` on the rank of stage 3.
  Backward goes the other way: ``3SEND_B0`` matches ``2RECV_B0``.
- The loss is computed inside the last stage's ``F``; its ``B`` (or ``I``)
  starts the backward chain.
- ``B`` is the full backward. Zero-bubble schedules split it into ``I`` (input
  gradient, on the critical path) and ``W`` (weight gradient, deferrable),
  Qi et al. 2024 §2.

fxpipe's own kinds, with no torch counterpart: the vocabulary passes ``S``/``T``
and their collectives ``BCAST_H``/``ALLREDUCE_S``/``REDUCE_G`` (vocab_actions.py).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ActionKind(enum.Enum):
    """What an action does; the value is its spelling in the text form."""

    F = "F"  # forward (the last stage's forward includes the loss)
    B = "B"  # full backward
    I = "I"  # backward for inputs (zero bubble)  # noqa: E741
    W = "W"  # backward for weights (zero bubble)
    # Vocabulary passes (Yeung et al. 2025, "S" and "T"): every rank's block of the
    # output layer, for one microbatch. Their stage field is the rank's vocabulary
    # block, which is also the rank's first stage (stage r lives on rank r in both
    # placements). See vocab_actions.py.
    S = "S"  # block logits, local max / sum-exp / target logit
    T = "T"  # block softmax grad, weight grad, partial grad of the last hidden state
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # Collectives of the vocabulary passes, one per rank per microbatch, in the same
    # order on every rank; posted without blocking, completed when all ranks posted.
    BCAST_H = "BCAST_H"  # the last stage's output hidden state to every rank (before S)
    ALLREDUCE_S = "ALLREDUCE_S"  # the S statistics combined (between S and T)
    REDUCE_G = "REDUCE_G"  # partial hidden-state gradients summed on the last stage (before its B)

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_p2p(self) -> bool:
        """SEND/RECV between neighbouring stages (what ``lower`` adds)."""
        return self in _P2P_KINDS

    @property
    def is_collective(self) -> bool:
        """A vocabulary-pass collective over all pipeline ranks."""
        return self in _COLLECTIVE_KINDS

    @property
    def is_vocab(self) -> bool:
        """A vocabulary pass or one of its collectives."""
        return self in _VOCAB_KINDS


_COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.S, ActionKind.T})
_P2P_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_COLLECTIVE_KINDS = frozenset({ActionKind.BCAST_H, ActionKind.ALLREDUCE_S, ActionKind.REDUCE_G})
_VOCAB_KINDS = _COLLECTIVE_KINDS | {ActionKind.S, ActionKind.T}

# Integer codes of the kinds in the flat arrays the numba kernels read.
KIND_CODE = {kind: code for code, kind in enumerate(ActionKind)}
KIND_OF_CODE = tuple(ActionKind)

# torch's _action_regex, less the FSDP/grad-reduction kinds (UNSHARD, RESHARD,
# REDUCE_GRAD) fxpipe's runtime handles outside the schedule.
_ACTION_RE = re.compile(
    r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BCAST_H|ALLREDUCE_S|REDUCE_G|F|B|I|W|S|T)(\d+)\s*$"
)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: run ``kind`` for ``microbatch`` on ``stage``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of ``str``: ``Action.parse("1SEND_B2") == Action(1, SEND_B, 2)``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected {{stage}}{{kind}}{{microbatch}} "
                f"with kind one of {[k.value for k in ActionKind]}, e.g. '3F0' or '1SEND_B2'"
            )
        stage, kind, microbatch = match.groups()
        return Action(int(stage), ActionKind(kind), int(microbatch))


def loop_stage_ranks(num_ranks: int, num_chunks: int) -> tuple[int, ...]:
    """Looped placement (Megatron SC21 §2.2): stage c lives on rank c mod p."""
    return tuple(stage % num_ranks for stage in range(num_ranks * num_chunks))


def v_stage_ranks(num_ranks: int) -> tuple[int, ...]:
    """V placement (ZB-V, DualPipeV): rank r holds stages r and 2p-1-r, so the
    first and the last stage share rank 0 and the turn at stage p-1 -> p is local."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
