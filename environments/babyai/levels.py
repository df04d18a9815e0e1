"""Task ids -> BabyAI levels and seeds, with AgentGym's mapping, and the fixed train/test splits.

AgentGym serves task `data_idx` as level `LEVELS[data_idx % 40]` reset with seed `data_idx // 40`.
Its data set has 900 tasks (810 train + 90 test). We keep the 900 tasks but hold out the last 120
ids as the test split, so every level appears exactly 3 times there (any 120 consecutive ids cover
each residue mod 40 three times) and an oracle check over the test split spans >= 100 tasks.
"""

from __future__ import annotations

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI-* ids with gymnasium)
from minigrid.envs.babyai.core import roomgrid_level
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel

# AgentGym's level order (its levels 1..40). minigrid 3.2.0 registers GoToObjS6 only as -v1
# (its -v0 is deprecated there); every other id is AgentGym's.
LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0",
    "BabyAI-GoToRedBall-v0",
    "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v1",
    "BabyAI-GoToLocalS8N7-v0",
    "BabyAI-GoToObjMazeS7-v0",
    "BabyAI-GoToImpUnlock-v0",
    "BabyAI-GoToSeqS5R2-v0",
    "BabyAI-GoToRedBlueBall-v0",
    "BabyAI-GoToDoor-v0",
    "BabyAI-GoToObjDoor-v0",
    "BabyAI-Open-v0",
    "BabyAI-OpenRedDoor-v0",
    "BabyAI-OpenDoorLoc-v0",
    "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0",
    "BabyAI-Pickup-v0",
    "BabyAI-UnblockPickup-v0",
    "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0",
    "BabyAI-PickupAbove-v0",
    "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0",
    "BabyAI-Unlock-v0",
    "BabyAI-UnlockLocalDist-v0",
    "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0",
    "BabyAI-BlockedUnlockPickup-v0",
    "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0",
    "BabyAI-FindObjS7-v0",
    "BabyAI-KeyCorridorS6R3-v0",
    "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0",
    "BabyAI-SynthS5R2-v0",
    "BabyAI-SynthLoc-v0",
    "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0",
    "BabyAI-BossLevel-v0",
    "BabyAI-BossLevelNoUnlock-v0",
)
NUM_TASKS = 900  # AgentGym's BabyAI data: 810 train + 90 test items
NUM_TEST = 120  # the last ids; 3 tasks of every level
TRAIN_IDS = tuple(range(NUM_TASKS - NUM_TEST))
TEST_IDS = tuple(range(NUM_TASKS - NUM_TEST, NUM_TASKS))

# Level generation prints "Sampling rejected: ..." for every rejected layout. Shadowing `print`
# in that one module keeps server logs readable and, unlike redirecting sys.stdout, is thread-safe.
roomgrid_level.print = lambda *args, **kwargs: None


def task(data_idx: int) -> tuple[str, int]:
    """Task id -> (level env id, reset seed): AgentGym's rule, valid for 0 <= data_idx < NUM_TASKS."""
    if not isinstance(data_idx, int) or isinstance(data_idx, bool) or not 0 <= data_idx < NUM_TASKS:
        raise ValueError(f"BabyAI task id must be an int in 0..{NUM_TASKS - 1}, got {data_idx!r}")
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def make(data_idx: int) -> RoomGridLevel:
    """A fresh engine for task `data_idx`, reset with its seed (same grid and mission in every process)."""
    level, seed = task(data_idx)
    engine = gymnasium.make(level).unwrapped  # no wrappers: the env checker only adds warnings
    engine.reset(seed=seed)
    return engine
