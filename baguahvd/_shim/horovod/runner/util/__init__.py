"""``horovod.runner.util``: the helper modules Horovod's launcher and tests import."""
