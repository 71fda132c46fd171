"""Our actions → poses → Plücker rays against vLLM-Omni's LingBot-World camera code.

Production's side is its action integrator (``integrate_lingbot_camera_actions``), its trajectory
and Plücker builder (``camera_trajectory_from_absolute_pose``, ``build_plucker_embedding``) and the
glue its pipeline runs around them per chunk (``_prepare_camera``: prepend the previous chunk's
last pose, or the identity for a session's first chunk, as the anchor; drop the anchor's rays;
pixel-unshuffle by 8). The glue lives in the pipeline module, which cannot be imported without
torchvision, so these tests restate it from its reading; everything that computes is theirs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from harness.engine import camera
from harness.engine.dit_engine import chunk_camera

H, W, FRAMES = 64, 128, 3
TOL = 1e-6

#: ≥ 10 chunks: walking, turns both ways, strafing, diagonals, opposing keys, idle chunks and
#: idle frames, pitching up into the 85° clamp (22 frames of "i") and back down, production's
#: list format and our strings in either case.
SESSION = [
    ["w", "w", "w"], ["wj", "wj", "j"], [["w", "l"], ["l"], []], ["", "", ""], ["d", "a", "wd"],
    ["s", "sa", "ws"], ["i", "i", "i"], ["i"] * 3, ["i"] * 3, ["i"] * 3, ["i"] * 3, ["i"] * 3,
    ["i", "i", "wi"], ["iw", "I", "W"], ["k", "k", "K"], ["jl", "ik", ""], [["W", "D"], [], ["s"]],
]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def production_rays(lingbot, chunks, *, poses_per_chunk=None):
    """Production's folded (384, F, h, w) camera map per chunk, for key actions (its action path)
    or for absolute poses (its pose-stream path, translations divided by the 0.05 step)."""
    A, C = lingbot.actions, lingbot.camera
    tail, pitch, out = None, 0.0, []
    for c in range(len(chunks if poses_per_chunk is None else poses_per_chunk)):
        if poses_per_chunk is None:
            frames = [list(a) if isinstance(a, str) else a for a in chunks[c]]
            traj, pitch = A.integrate_lingbot_camera_actions(
                frames, width=W, height=H, initial_pose=None if tail is None else tail.poses[-1], initial_pitch=pitch)
            scale = None
        else:
            traj = A.camera_trajectory_from_absolute_pose(torch.from_numpy(poses_per_chunk[c]), width=W, height=H)
            scale = A.LINGBOT_CONTROLLER_TRANSLATION_UNIT
        anchor = tail if tail is not None else C.CameraTrajectory(
            poses=torch.eye(4, dtype=traj.poses.dtype)[None], intrinsics=traj.intrinsics[:1])
        full = C.CameraTrajectory(poses=torch.cat((anchor.poses, traj.poses)),
                                  intrinsics=torch.cat((anchor.intrinsics, traj.intrinsics)))
        emb = C.build_plucker_embedding(full, height=H, width=W, target_height=H, target_width=W,
                                        device=torch.device("cpu"), dtype=torch.float32, translation_scale=scale)[1:]
        tail = C.CameraTrajectory(poses=traj.poses[-1:].clone(), intrinsics=traj.intrinsics[-1:].clone())
        out.append(F.pixel_unshuffle(emb, 8).permute(1, 0, 2, 3))
    return out


def our_rays(chunks=None, poses_per_chunk=None):
    rays = camera.CameraRays(H, W, torch.device("cpu"))
    state, out, states = camera.CameraState.start(), [], []
    n = len(chunks if poses_per_chunk is None else poses_per_chunk)
    for c in range(n):
        rel, state = chunk_camera(state, None if chunks is None else chunks[c],
                                  None if poses_per_chunk is None else poses_per_chunk[c], FRAMES)
        out.append(rays(rel))
        states.append(state)
    return out, states


def test_action_session_matches_production(lingbot, record_property):
    theirs = production_rays(lingbot, SESSION)
    ours, states = our_rays(SESSION)
    errs = [rel_l2(a, b) for a, b in zip(ours, theirs)]
    record_property("camera_rel_l2_per_chunk", errs)
    print("camera rel-L2 per chunk (actions):", " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= TOL, errs
    # the session really exercised the clamp: pitch stopped at 84° (21 steps of 4°) while "i" was held
    pitches = [round(np.degrees(s.pitch), 6) for s in states]
    assert 84.0 in pitches and max(pitches) <= camera.PITCH_LIMIT_DEG
    # and the camera moved, turned and stood still: the maps are not all alike
    assert rel_l2(ours[0], ours[3]) > 0.1 and rel_l2(ours[1], ours[0]) > 0.01


def test_pose_stream_matches_production(lingbot):
    """Explicit poses (a client streaming absolute camera poses): production divides by the step."""
    world, _ = camera.integrate_actions(camera.validate_actions(["w", "wl", "wi"] * 4, 12), camera.CameraState.start())
    chunks = [world[i:i + FRAMES] for i in range(0, 12, FRAMES)]
    errs = [rel_l2(a, b) for a, b in zip(our_rays(poses_per_chunk=chunks)[0],
                                          production_rays(lingbot, None, poses_per_chunk=chunks))]
    print("camera rel-L2 per chunk (poses):", " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= TOL, errs


def test_action_format_as_production_sends_it():
    assert camera.validate_actions([["w", "j"], [], ["L", "i"]], 3) == ["wj", "", "il"]
    assert camera.validate_actions(["WJ", "", "li"], 3) == ["wj", "", "il"]
