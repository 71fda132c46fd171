"""Our actions → poses → Plücker rays against vLLM-Omni's LingBot-World camera code.

Production's side is its action integrator (``integrate_lingbot_camera_actions``), its trajectory
and Plücker builder (``camera_trajectory_from_absolute_pose``, ``build_plucker_embedding``) and the
glue its pipeline runs around them per chunk (``_prepare_camera``: prepend the previous chunk's
last pose, or the identity for a session's first chunk, as the anchor; drop the anchor's rays;
pixel-unshuffle by 8). The glue lives in the pipeline module, which cannot be imported without
torchvision, so tests/helpers/omni_production.py restates it from its reading; everything that
computes is theirs.
"""

from __future__ import annotations

import numpy as np
import torch
from helpers import omni_production

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
    return omni_production.production_rays(lingbot, chunks, height=H, width=W, poses_per_chunk=poses_per_chunk)


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


#: 64 chunks forward, turning right and back every 8th: ≈ 9.6 units from the origin at the end,
#: where the float32 rounding of the absolute poses (≈ 1e-6) is 2e-5 of a 0.05 step
WALK = [["wl", "w", "wj"] if c % 8 == 0 else ["w", "w", "w"] for c in range(64)]


def _fp64_rays(chunks) -> list[torch.Tensor]:
    """The walk's rays with the poses differenced in float64 (the convention before production's)."""
    rays, state, out = camera.CameraRays(H, W, torch.device("cpu")), camera.CameraState.start(), []
    for acts in chunks:
        world, pitch = camera.integrate_actions(camera.validate_actions(acts, FRAMES), state)
        prev = np.concatenate([state.pose[None], world[:-1]])
        rt = prev[:, :3, :3].transpose(0, 2, 1)
        rel = np.tile(np.eye(4), (FRAMES, 1, 1))
        rel[:, :3, :3] = rt @ world[:, :3, :3]
        rel[:, :3, 3] = (rt @ (world[:, :3, 3] - prev[:, :3, 3])[..., None])[..., 0]
        rel[:, :3, 3] /= max(np.linalg.norm(rel[:, :3, 3], axis=-1).max(), 1e-30)
        out.append(rays(torch.from_numpy(rel).float()))
        state = camera.CameraState(world[-1].copy(), pitch)
    return out


def test_a_long_walk_matches_production_at_distance(lingbot, record_property):
    """Both sides round the absolute poses to float32 before differencing them, in the same order.
    Differencing in float64 instead (computed here too) passes 1e-6 only near the origin."""
    ours, states = our_rays(WALK)
    theirs = production_rays(lingbot, WALK)
    errs = [rel_l2(a, b) for a, b in zip(ours, theirs)]
    fp64 = [rel_l2(a, b) for a, b in zip(_fp64_rays(WALK), theirs)]
    world, _ = camera.integrate_actions(camera.validate_actions([a for c in WALK for a in c], 3 * len(WALK)),
                                        camera.CameraState.start())
    chunks = [world[i:i + FRAMES] for i in range(0, len(world), FRAMES)]
    pose_errs = [rel_l2(a, b) for a, b in zip(our_rays(poses_per_chunk=chunks)[0],
                                               production_rays(lingbot, None, poses_per_chunk=chunks))]
    distance = float(np.linalg.norm(states[-1].pose[:3, 3]))
    record_property("walk_rel_l2_max", max(errs))
    record_property("walk_pose_stream_rel_l2_max", max(pose_errs))
    record_property("walk_fp64_rel_l2_max", max(fp64))
    past = next((c for c, e in enumerate(fp64) if e > TOL), None)
    print(f"64-chunk walk to {distance:.2f} units: rel-L2 max {max(errs):.2e} (actions), "
          f"{max(pose_errs):.2e} (poses); last chunk {errs[-1]:.2e}, {pose_errs[-1]:.2e}; "
          f"fp64 differencing: max {max(fp64):.2e}, past {TOL:g} from chunk {past} "
          f"({float(np.linalg.norm(states[past].pose[:3, 3])) if past is not None else float('nan'):.2f} units)")
    assert distance > 9.0 and len(errs) == len(pose_errs) == 64
    assert max(fp64) > TOL  # the walk is far enough for the convention to matter
    assert max(errs) <= TOL and max(pose_errs) <= TOL, (errs, pose_errs)


def test_action_format_as_production_sends_it():
    assert camera.validate_actions([["w", "j"], [], ["L", "i"]], 3) == ["wj", "", "il"]
    assert camera.validate_actions(["WJ", "", "li"], 3) == ["wj", "", "il"]
