"""``hvd.elastic``'s State in one process, outside any launcher that hosts its folder."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from baguahvd.common import elastic_protocol as protocol
from baguahvd.torch.elastic.base import ObjectState


def _state(rank: int) -> ObjectState:
    def broadcast(value: Any, root: int, name: str | None = None) -> Any:
        return value

    return ObjectState(broadcast, lambda: rank, epoch=0)


@pytest.mark.parametrize("agent", [True, False], ids=["agent", "no-agent"])
def test_committing_under_torchrun_s_agent_without_a_folder_warns_once_on_rank_0(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, agent: bool
) -> None:
    monkeypatch.delenv(protocol.ELASTIC_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if agent:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    first, other = _state(0), _state(1)
    with caplog.at_level(logging.WARNING, logger="baguahvd"):
        for _ in range(3):
            first.commit()
            other.commit()
    warnings = [r.getMessage() for r in caplog.records if "BAGUAHVD_ELASTIC_DIR" in r.getMessage()]
    assert len(warnings) == (1 if agent else 0), warnings
    if agent:
        assert "restarts start training from the beginning" in warnings[0]
