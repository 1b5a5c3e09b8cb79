"""CPU tests of ``sph.py`` (rotation, per-head spherical quantiser, k-means) and of the
``sim:sph`` backend's file handling.

    .venv-torch/bin/python -m pytest -q benches/quality/test_sph.py
"""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
import sph  # noqa: E402


def test_rotation_is_orthogonal_and_matches_the_contract_signs():
    # Same signs as the Rust `rotate_row` test (crates/kvforge/src/commands/codebook.rs).
    assert sph.signs(8).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    y = sph.rotate(x)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), atol=1e-5)
    assert torch.allclose(sph.unrotate(y), x, atol=1e-5)
    e = torch.eye(8)
    r = sph.rotate(e)  # row c = R e_c; first entry s_c / sqrt(8)
    assert torch.allclose(r[:, 0] * 8 ** 0.5, sph.signs(8))


def test_quantize_keys_uses_each_head_and_groups_codebook():
    h, t, d, group = 2, 6, 8, 4
    # head 0 group 0's codebook holds e0, every other (head, group) holds e1: keys along e0
    # come back along e0 only in head 0 group 0.
    cbs = torch.zeros(h, d // group, 2, group)
    cbs[..., 0, 1] = 1.0
    cbs[..., 1, 1] = 1.0
    cbs[0, 0, 0] = torch.tensor([1.0, 0, 0, 0])
    k = torch.zeros(h, t, d)
    k[:, :, 0] = 2.0
    k[:, :, 4] = 3.0
    kq = sph.quantize_keys(k, cbs, sph.radius_scales(k, group))
    assert torch.allclose(kq[0, :, 0], torch.full((t,), 2.0), atol=0.02)
    assert torch.allclose(kq[1, :, 1], torch.full((t,), 2.0), atol=0.02)  # head 1: best is e1
    assert torch.allclose(kq[:, :, 5], torch.full((h, t), 3.0), atol=0.02)  # group 1 holds e1 only


def test_kmeans_finds_separated_directions():
    g = torch.Generator().manual_seed(1)
    dirs = torch.eye(4)[None].repeat(1, 100, 1)  # e0..e3 repeated
    x = dirs + 0.02 * torch.randn(dirs.shape, generator=g)
    w = sph.kmeans(x, 4, iters=10, seed=3)[0]
    assert (w @ torch.eye(4)).amax(dim=0).min() > 0.99


def test_sim_sph_backend_round_trips_a_per_head_file(tmp_path):
    from safetensors.torch import save_file

    L, H, d, group, e = 2, 3, 64, 16, 4
    cbs = sph.unit(torch.randn(L, H, d // group, e, group, generator=torch.Generator().manual_seed(2)))
    f = tmp_path / "cb.safetensors"
    save_file({"codebooks": cbs.contiguous()}, str(f), metadata={"basis": "hadamard:0x5eed"})
    b = kvq.make_backend(f"sim:sph:{f}")
    assert b.rot_seed == 0x5EED and b.group == group and b.entries == e
    q, k, v = torch.randn(9, 130, d), torch.randn(H, 130, d), torch.randn(H, 130, d)
    out = b.attend(1, q, k, v, 0.125)
    assert out.shape == (130, 9, d) and torch.isfinite(out).all()
    assert b.bytes_per_token(d) == 4 + 1 + 128
