"""The made-up rule of ``made_up_rule.py`` with its update in C only: a rule one kernel family has no form of. The
Triton kernels leave its parameters to the compiled path, saying why, and offloaded state, which streams through them,
refuses it; the fused C step runs it."""

from __future__ import annotations

import dataclasses

from made_up_rule import DECAYING_MOMENTUM, DecayingMomentum8bit

DECAYING_MOMENTUM_C_ONLY = dataclasses.replace(DECAYING_MOMENTUM, name="decaying_momentum_c_only", triton_update=None)


class DecayingMomentumCOnly8bit(DecayingMomentum8bit):
    """:class:`~made_up_rule.DecayingMomentum8bit` with :data:`DECAYING_MOMENTUM_C_ONLY`."""

    def _fused_rule(self, group):
        return DECAYING_MOMENTUM_C_ONLY
