"""Where this process sits in a gloo job, as its launcher announced it.

torchrun and horovodrun give every process its rank, its rank on its node (local) and its
node's index (cross) in variables (:class:`~baguahvd.common.config.Launch`); nothing has to
be discovered. ``is_homogeneous`` (every node runs the same number of ranks) is the one
fact a rank cannot know alone: the local sizes are gathered once over the control plane.
"""

from __future__ import annotations

from baguahvd.backends.base import ControlPlane
from baguahvd.common.config import Launch


class Topology:
    """Ranks of this process in the job, on its node, and across nodes."""

    def __init__(self, launch: Launch, control: ControlPlane) -> None:
        self.rank = launch.rank
        self.size = launch.size
        self.local_rank = launch.local_rank
        self.local_size = launch.local_size
        self.cross_rank = launch.cross_rank
        self.cross_size = launch.cross_size
        if self.size > 1:
            local_sizes = control.allgather_ints([self.local_size])
            self.is_homogeneous = len({sizes[0] for sizes in local_sizes}) == 1
        else:
            self.is_homogeneous = True

    def free(self) -> None:
        return None
