"""Production's camera conventions as pure maths, without vLLM-Omni (whose equivalence tests skip
without the extra): pitch turns about the camera's own x axis whatever the yaw, and explicit poses
keep their translations (divided by the 0.05 step, not by the chunk's largest one)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.engine import camera
from harness.engine.dit_engine import chunk_camera


def _after(actions: list[str]) -> np.ndarray:
    return camera.integrate_actions(camera.validate_actions(actions, len(actions)), camera.CameraState.start())[0][-1]


def test_pitch_after_a_yaw_turns_about_the_cameras_own_axis():
    yawed = _after(["l"] * 15)  # 90° right: the camera looks along world +x
    assert np.allclose(yawed[:3, 2], [1, 0, 0], atol=1e-12)
    pitched = _after(["l"] * 15 + ["i"])
    right, forward = pitched[:3, 0], pitched[:3, 2]
    # the camera's own x axis is the rotation axis: it does not move, and forward tilts up (−y) in its plane
    assert np.allclose(right, yawed[:3, 0], atol=1e-12)
    a = math.radians(camera.PITCH_STEP_DEG)
    assert np.allclose(forward, [math.cos(a), -math.sin(a), 0], atol=1e-12)


def test_explicit_poses_keep_their_translations():
    frames = 3
    steps = [0.1, 0.05, 0.025]  # two, one and half a step forward
    poses = np.stack([np.eye(4)] * frames)
    poses[:, 2, 3] = np.cumsum(steps)
    rel, state = chunk_camera(camera.CameraState.start(), None, poses, frames)
    assert rel[:, 2, 3].tolist() == pytest.approx([s / camera.TRANSLATE_STEP for s in steps], rel=1e-6)
    assert np.allclose(state.pose, poses[-1])
    # actions are production's other path: divided by the chunk's largest step
    rel_a, _ = chunk_camera(camera.CameraState.start(), ["w", "w", ""], None, frames)
    assert np.linalg.norm(rel_a[:, :3, 3].numpy(), axis=-1).tolist() == pytest.approx([1, 1, 0], abs=1e-6)
