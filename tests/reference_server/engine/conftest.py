from __future__ import annotations

import itertools

import pytest
import torch

from reference_server.engine.config import DEFAULT_SLO_CLASSES
from reference_server.engine.sequence import Sequence

torch.set_num_threads(1)

SLO = {c.name: c for c in DEFAULT_SLO_CLASSES}


@pytest.fixture()
def make_seq():
    """Factory of bare sequences (no model needed): ``make_seq("a", [1, 2, 3])``."""
    counter = itertools.count()

    def make(request_id: str, token_ids: list[int], *, tenant: str = "default", slo_class: str = "interactive",
             arrival_ns: int = 0, max_len: int = 10_000) -> Sequence:
        return Sequence(request_id, list(token_ids), None, seq_no=next(counter), tenant=tenant,
                        slo_class=SLO[slo_class], arrival_ns=arrival_ns, max_len=max_len)

    return make
