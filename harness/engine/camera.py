"""Camera control: keyboard actions → camera-to-world poses → Plücker rays on the latent grid.

Interactive clients send one action per latent frame: a string of keys from W A S D (move
forward / left / back / right) and I J K L (pitch up / yaw left / pitch down / yaw right), "" for
no motion. Each key is a fixed step in the camera's own frame, so "W" always moves where the camera
looks. Poses are integrated on the host in float64 (a handful of 4×4 matrices per chunk) and the
per-pixel rays are built on the device from a precomputed direction grid, so a chunk costs one tiny
H2D copy (F×4×4 floats), not a pixel-sized one.

Conventions (OpenCV camera): x right, y down, z forward. Ray channels per pixel: origin (3) then
direction (3); pixel-unshuffled by 8 as channel = c·64 + dy·8 + dx, giving (384, F, h, w).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from harness.config import RAY_CHANNELS, VAE_SPATIAL
from harness.errors import HarnessError

KEYS = "WASDIJKL"
#: Scene units per latent frame (4 pixel frames, 0.25 s at 16 fps): a slow walk.
TRANSLATE_STEP = 0.1
#: Degrees per latent frame: a 90° turn takes 30 latent frames (7.5 s).
ROTATE_STEP_DEG = 3.0
#: Horizontal field of view of the default pinhole camera.
DEFAULT_HFOV_DEG = 60.0
ORTHONORMAL_TOL = 1e-3

_TRANSLATION = {"W": (0, 0, 1), "S": (0, 0, -1), "A": (-1, 0, 0), "D": (1, 0, 0)}
# Pitch is a rotation about the camera x axis (positive tilts the view to −y, i.e. up); yaw is
# about the y axis, which points down, so a positive angle turns toward +x (right).
_ROTATION = {"I": ("x", 1), "K": ("x", -1), "J": ("y", -1), "L": ("y", 1)}


def validate_actions(actions: object, frames: int) -> list[str]:
    if not isinstance(actions, (list, tuple)):
        raise HarnessError(f"actions must be a list of {frames} strings (one per latent frame), got {type(actions).__name__}")
    if len(actions) != frames:
        raise HarnessError(f"expected {frames} actions (one per latent frame), got {len(actions)}")
    for i, a in enumerate(actions):
        if not isinstance(a, str):
            raise HarnessError(f"action {i} must be a string of keys from {KEYS}, got {type(a).__name__}")
        bad = sorted(set(a) - set(KEYS))
        if bad:
            raise HarnessError(f"action {i} {a!r} has invalid key(s) {''.join(bad)!r}; allowed keys: {KEYS} (or empty)")
    return list(actions)


def _rot(axis: str, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    if axis == "x":
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float64)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float64)


def action_delta(action: str) -> np.ndarray:
    """The camera-local motion of one latent frame as a 4×4 transform (keys combine; W+S cancel)."""
    delta = np.eye(4, dtype=np.float64)
    keys = set(action)
    t = np.zeros(3)
    for k in keys & _TRANSLATION.keys():
        t += np.asarray(_TRANSLATION[k], dtype=np.float64)
    delta[:3, 3] = t * TRANSLATE_STEP
    step = math.radians(ROTATE_STEP_DEG)
    r = np.eye(3)
    for axis in ("y", "x"):  # yaw then pitch, so pitching never rolls the horizon
        sign = sum(v for k, (a, v) in _ROTATION.items() if a == axis and k in keys)
        if sign:
            r = r @ _rot(axis, sign * step)
    delta[:3, :3] = r
    return delta


def integrate_actions(actions: list[str], start_pose: np.ndarray) -> np.ndarray:
    """Camera-to-world poses (F, 4, 4): frame j = frame j−1 moved by action j (frame −1 = start_pose)."""
    poses = np.empty((len(actions), 4, 4), dtype=np.float64)
    pose = np.asarray(start_pose, dtype=np.float64)
    for j, a in enumerate(actions):
        pose = pose @ action_delta(a)
        poses[j] = pose
    return poses


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


def relative_poses(poses: np.ndarray, first_pose: np.ndarray) -> np.ndarray:
    """Poses in the frame of the session's first camera (so the first frame is the identity)."""
    f = np.asarray(first_pose, dtype=np.float64)
    inv = np.eye(4)
    inv[:3, :3] = f[:3, :3].T
    inv[:3, 3] = -f[:3, :3].T @ f[:3, 3]
    return inv[None] @ poses


def default_intrinsics(height: int, width: int) -> tuple[float, float, float, float]:
    """(fx, fy, cx, cy) of a square-pixel pinhole with DEFAULT_HFOV_DEG across the width."""
    fx = 0.5 * width / math.tan(math.radians(DEFAULT_HFOV_DEG) / 2)
    return fx, fx, width / 2, height / 2


class CameraRays:
    """Builds the (384, F, h, w) ray map for relative poses on the device.

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
