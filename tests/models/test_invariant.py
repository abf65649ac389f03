"""Row padding that makes GEMMs (and causal attention) batch-invariant on the host."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from xspec.models import invariant
from xspec.models.invariant import PaddedRows, probe_row_tile

CPU = torch.device("cpu")
TILE = probe_row_tile(CPU, torch.float32)
pytestmark = pytest.mark.skipif(TILE is None, reason="this host's BLAS has no row tile")

K, N = 256, 192
GEN = torch.Generator().manual_seed(3)
W = torch.randn(N, K, generator=GEN)
X = torch.randn(12, K, generator=GEN)
B = torch.randn(3, K, N, generator=GEN)
BASE = torch.randn(N, generator=GEN)

# name -> f(x): the op on the rows ``x [m, K]`` (rows on dim -2 of the result)
OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "linear": lambda x: F.linear(x, W, BASE),
    "linear_3d": lambda x: F.linear(x[None], W),
    "matmul": lambda x: torch.matmul(x, W.t()),
    "operator": lambda x: x @ W.t(),
    "method": lambda x: x.matmul(W.t()),
    "mm": lambda x: torch.mm(x, W.t()),
    "addmm": lambda x: torch.addmm(BASE, x, W.t()),
    "bmm": lambda x: torch.bmm(x.expand(3, *x.shape), B),
    "baddbmm": lambda x: torch.baddbmm(BASE.view(1, 1, N), x.expand(3, *x.shape), B),
}


def _tile() -> int:
    assert TILE is not None
    return max(TILE, 2)


@pytest.mark.parametrize("name", list(OPS))
def test_every_row_equals_the_row_alone_under_padding(name: str) -> None:
    op = OPS[name]
    with PaddedRows(_tile()):
        alone = [op(X[r : r + 1]) for r in range(12)]
        for m in range(1, 13):
            got = op(X[:m])
            for r in range(m):  # row r of an m-row call is the one-row call's, bit for bit
                assert torch.equal(got[..., r : r + 1, :], alone[r]), (name, m, r)
        padded = op(X[:5])
    torch.testing.assert_close(padded, op(X[:5]))  # the values, up to rounding


def test_without_padding_this_blas_rounds_rows_by_call_size() -> None:
    """The negative control: what the mode removes is there without it (on a BLAS whose
    tile is 1 there is nothing to remove)."""
    if TILE == 1:
        pytest.skip("this host's GEMMs are row-invariant as they come")
    full = F.linear(X, W)
    assert any(not torch.equal(F.linear(X[:m], W), full[:m]) for m in range(1, 12))


def test_causal_attention_rows_attend_as_one_row_decoding_alone() -> None:
    q = torch.randn(1, 4, 6, 16, generator=GEN)
    k = torch.randn(1, 4, 20, 16, generator=GEN)
    v = torch.randn(1, 4, 20, 16, generator=GEN)
    past = 14
    mask = torch.arange(20)[None, :] <= past + torch.arange(6)[:, None]  # [6, 20]
    with PaddedRows(_tile()):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(q, k[:, :, :6], v[:, :, :6], is_causal=True)
    for r in range(6):
        n = past + r + 1
        alone = F.scaled_dot_product_attention(q[:, :, r : r + 1], k[:, :, :n], v[:, :, :n])
        assert torch.equal(got[:, :, r : r + 1], alone), r
        short = F.scaled_dot_product_attention(
            q[:, :, r : r + 1], k[:, :, : r + 1], v[:, :, : r + 1]
        )
        assert torch.equal(causal[:, :, r : r + 1], short), r
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want)


def test_a_mask_that_is_not_a_prefix_runs_as_it_comes() -> None:
    mask = torch.tensor([[True, False, True], [True, True, True]])
    assert invariant._prefix_lengths(mask, 2, 3) is None
    assert invariant._prefix_lengths(torch.tril(torch.ones(3, 3, dtype=torch.bool)), 3, 3) == [
        1,
        2,
        3,
    ]
    assert invariant._prefix_lengths(torch.zeros(2, 3), 2, 3) is None  # additive: not read


def test_integer_and_out_calls_are_left_alone() -> None:
    a = torch.randint(0, 5, (3, 4))
    with PaddedRows(4):
        assert torch.equal(a @ a.t(), (a @ a.t()))
        out = torch.empty(3, 3)
        torch.mm(a.float(), a.float().t(), out=out)
    assert torch.equal(out, a.float() @ a.float().t())


def test_probe_finds_no_tile_where_rows_round_by_call_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GEMM whose every row depends on the call's row count has no tile."""
    real = F.linear

    def drifting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
        return real(x, w, b) * (1 + 1e-7 * x.shape[0])

    monkeypatch.setattr(invariant.F, "linear", drifting)
    assert probe_row_tile(CPU, torch.float32) is None


def test_tile_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="tile >= 2"):
        PaddedRows(1)
