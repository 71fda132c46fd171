"""Camera control: keyboard actions → camera-to-world poses → Plücker rays on the latent grid.

The conventions are production's (vLLM-Omni's LingBot-World serving, which follows SGLang's
LingBot adapter), so a client that drives production drives the harness the same way and the
model is conditioned on the same rays (tests/engine/omni checks this against vLLM-Omni's own code):

* actions: one per latent frame, the keys held during that frame from w a s d (move forward /
  left / back / right) and i j k l (pitch up / yaw left / pitch down / yaw right). A frame is
  given as production sends it, a list of keys (``["w", "j"]``, ``[]`` for none), or as a string
  of keys (``"wj"``, ``""``); either case. Opposite keys cancel.
* motion: per latent frame, yaw 6° about the world's vertical axis, pitch 4° about the camera's
  own x axis (the accumulated pitch is kept within ±85°: a step that would leave it is dropped),
  translation 0.05 along the camera's forward / right directions projected onto the ground plane
  (so looking down does not move the camera down). Poses are integrated in float64 from the
  session's first pose (the identity) and carried across chunks with the accumulated pitch;
  they are rounded to float32 before they are differenced (production's order, framewise_poses).
* pose encoding: each frame's pose relative to the previous frame's (the chunk's first frame
  relative to the previous chunk's last; a session starts from the identity). Translations are
  divided by the largest one in the chunk for actions (production's action path), or by the
  0.05 step for explicit poses (production's pose-stream path).
* intrinsics: a pinhole with fx = fy = 500 pixels at the served resolution, centred.

OpenCV camera axes: x right, y down, z forward. Ray channels per pixel: origin (3) then direction
(3); pixel-unshuffled by 8 as channel = c·64 + dy·8 + dx, giving (384, F, h, w).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from harness.config import RAY_CHANNELS, VAE_SPATIAL
# the keys and their validation live apart, without torch, for the client and the trace parser
from harness.engine.keys import KEYS, normalize_action, validate_actions  # noqa: F401
from harness.errors import HarnessError

TRANSLATE_STEP = 0.05
YAW_STEP_DEG = 6.0
PITCH_STEP_DEG = 4.0
PITCH_LIMIT_DEG = 85.0
FOCAL_PX = 500.0
#: production divides the ground-plane forward/right vectors by (norm + this), not by the norm
DIRECTION_EPS = 1e-6
ORTHONORMAL_TOL = 1e-3


@dataclass
class CameraState:
    """Where a session's camera is after its last committed chunk: the world pose and the
    accumulated pitch (radians), the state production carries between chunks."""

    pose: np.ndarray
    pitch: float = 0.0

    @classmethod
    def start(cls) -> "CameraState":
        return cls(np.eye(4, dtype=np.float64), 0.0)


def _rot(axis: str, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    if axis == "x":
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float64)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float64)


def _ground(v: np.ndarray) -> np.ndarray:
    """``v`` projected onto the ground plane (y = 0) and scaled to (almost) unit length."""
    g = np.array([v[0], 0.0, v[2]])
    n = np.linalg.norm(g)
    return g / (n + DIRECTION_EPS) if n > 0 else g


def integrate_actions(actions: list[str], state: CameraState) -> tuple[np.ndarray, float]:
    """Camera-to-world poses (F, 4, 4) after each frame's action, and the accumulated pitch."""
    pose, pitch = np.asarray(state.pose, dtype=np.float64), float(state.pitch)
    limit = math.radians(PITCH_LIMIT_DEG)
    poses = np.empty((len(actions), 4, 4), dtype=np.float64)
    for j, keys in enumerate(actions):
        d_pitch = math.radians(PITCH_STEP_DEG) * (("i" in keys) - ("k" in keys))
        if -limit <= pitch + d_pitch <= limit:
            pitch += d_pitch
        else:
            d_pitch = 0.0
        d_yaw = math.radians(YAW_STEP_DEG) * (("l" in keys) - ("j" in keys))
        r = _rot("y", d_yaw) @ pose[:3, :3] @ _rot("x", d_pitch)  # yaw about the world, pitch local
        move = (_ground(r[:, 2]) * TRANSLATE_STEP * (("w" in keys) - ("s" in keys))
                + _ground(r[:, 0]) * TRANSLATE_STEP * (("d" in keys) - ("a" in keys)))
        t = pose[:3, 3] + move
        pose = np.eye(4, dtype=np.float64)
        pose[:3, :3], pose[:3, 3] = r, t
        poses[j] = pose
    return poses, pitch


def validate_poses(poses: object, frames: int | None = None) -> np.ndarray:
    """Check explicit camera-to-world poses: (F, 4, 4), finite, rigid (orthonormal, det +1)."""
    p = np.asarray(poses.detach().cpu() if isinstance(poses, Tensor) else poses, dtype=np.float64)
    if p.ndim != 3 or p.shape[1:] != (4, 4):
        raise HarnessError(f"poses must have shape (frames, 4, 4), got {tuple(p.shape)}")
    if frames is not None and p.shape[0] != frames:
        raise HarnessError(f"expected {frames} poses (one per latent frame), got {p.shape[0]}")
    if not np.isfinite(p).all():
        raise HarnessError(f"pose {int(np.argwhere(~np.isfinite(p))[0][0])} has non-finite values")
    for i, m in enumerate(p):
        if np.abs(m[3] - (0, 0, 0, 1)).max() > ORTHONORMAL_TOL:
            raise HarnessError(f"pose {i}: last row must be (0, 0, 0, 1), got {m[3].tolist()}")
        r = m[:3, :3]
        err = np.abs(r.T @ r - np.eye(3)).max()
        if err > ORTHONORMAL_TOL:
            raise HarnessError(f"pose {i}: rotation is not orthonormal (max |RᵀR − I| = {err:.3g} > {ORTHONORMAL_TOL})")
        if np.linalg.det(r) < 0:
            raise HarnessError(f"pose {i}: rotation is a reflection (det < 0)")
    return p


def _inverse(poses: Tensor) -> Tensor:
    """Rigid inverses (R, t) → (Rᵀ, −Rᵀt)."""
    rt = poses[:, :3, :3].transpose(-1, -2)
    out = torch.eye(4, dtype=poses.dtype).repeat(poses.shape[0], 1, 1)
    out[:, :3, :3] = rt
    out[:, :3, 3:] = -torch.bmm(rt, poses[:, :3, 3:])
    return out


def framewise_poses(anchor: np.ndarray, poses: np.ndarray, translation_scale: float | None) -> Tensor:
    """Each frame's pose relative to the previous one (frame 0's to ``anchor``), (F, 4, 4) float32,
    translations divided by ``translation_scale``, or by the chunk's largest translation when None
    (no division when the chunk does not move).

    Computed as production computes it: the absolute poses (integrated in float64) are rounded to
    float32 first, made relative to the anchor, then to the previous frame, all in float32. Far
    from the origin the rounding of the absolute poses is most of a small step (≈ 1e-6 at 10 units
    against a 0.05 step), so differencing them in float64 instead would give other rays there."""
    raw = torch.from_numpy(np.concatenate([np.asarray(anchor, dtype=np.float64)[None], poses])).to(torch.float32)
    rel = torch.matmul(_inverse(raw[:1]), raw)
    rel[0] = torch.eye(4, dtype=rel.dtype)
    rel[1:] = torch.bmm(_inverse(rel[:-1]), rel[1:])
    t = rel[:, :3, 3]
    scale = torch.linalg.vector_norm(t, dim=-1).max() if translation_scale is None else translation_scale
    if float(scale) > 0:
        rel[:, :3, 3] = t / scale
    return rel[1:]


def default_intrinsics(height: int, width: int) -> tuple[float, float, float, float]:
    """(fx, fy, cx, cy): production's pinhole, 500-pixel focal length at any resolution."""
    return FOCAL_PX, FOCAL_PX, width / 2, height / 2


class CameraRays:
    """Builds the (384, F, h, w) ray map for framewise poses on the device.

    The unit viewing direction of every pixel centre is fixed by the intrinsics, so it is computed
    once; per chunk only the (F, 4, 4) poses change.
    """

    def __init__(self, height: int, width: int, device: torch.device,
                 intrinsics: tuple[float, float, float, float] | None = None):
        if height % VAE_SPATIAL or width % VAE_SPATIAL:
            raise HarnessError(f"ray map {height}x{width} must be divisible by {VAE_SPATIAL}")
        self.height, self.width, self.device = height, width, device
        fx, fy, cx, cy = intrinsics or default_intrinsics(height, width)
        ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float64) + 0.5,
                                torch.arange(width, dtype=torch.float64) + 0.5, indexing="ij")
        d = torch.stack([(xs - cx) / fx, (ys - cy) / fy, torch.ones_like(xs)], dim=-1).reshape(-1, 3)
        self.dirs = (d / d.norm(dim=-1, keepdim=True)).to(device=device, dtype=torch.float32)

    def __call__(self, rel_poses: Tensor) -> Tensor:
        f = rel_poses.shape[0]
        r, t = rel_poses[:, :3, :3], rel_poses[:, :3, 3]
        rays_d = torch.matmul(self.dirs, r.transpose(-1, -2))  # (F, HW, 3)
        rays_o = t[:, None, :].expand_as(rays_d)
        rays = torch.cat([rays_o, rays_d], dim=-1)  # (F, HW, 6)
        s = VAE_SPATIAL
        h, w = self.height // s, self.width // s
        rays = rays.view(f, h, s, w, s, RAY_CHANNELS).permute(5, 2, 4, 0, 1, 3)
        return rays.reshape(RAY_CHANNELS * s * s, f, h, w)
