"""ByteGrad: gradients averaged with 8-bit MinMaxUInt8 compression (Bagua).

Per bucket of length L (padded to a multiple of the n ranks), with chunk j belonging to
rank j (:class:`~baguahvd.torch.algorithms.primitives.MinMaxUInt8`):

1. compress the bucket into n chunks, each with its own min/max;
2. alltoall the compressed chunks, so this rank receives every rank's copy of its chunk;
3. decompress them and reduce (mean or sum, fp32 accumulation) into this rank's chunk;
4. compress the reduced chunk once more and allgather it;
5. decompress every rank's reduced chunk into the bucket.

Every rank ends with bit-identical gradients, having sent about a quarter of fp32's bytes.
Hierarchical: the node average is full precision; the compressed exchange runs among node
leaders; the result is broadcast inside the node.
"""

from __future__ import annotations

from baguahvd.torch.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, check_bool
from baguahvd.torch.algorithms.gradient_allreduce import CentralizedReduceImpl
from baguahvd.torch.algorithms.primitives import Compressor, MinMaxUInt8, check_compressible


class ByteGradAlgorithm(Algorithm):
    """8-bit compressed gradient averaging.

    Args:
        hierarchical: full-precision node average, compressed exchange among node leaders
            (Bagua's default: True).
        average: mean (True) or sum (False) of the gradients.
    """

    name = "bytegrad"

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        check_compressible(self.name, context.parameters, "gradients")
        return _ByteGradImpl(self, context)


class _ByteGradImpl(CentralizedReduceImpl):
    algorithm: ByteGradAlgorithm  # type: ignore[assignment]
    alignment_by_size = True

    def compressor(self) -> Compressor:
        return MinMaxUInt8()
