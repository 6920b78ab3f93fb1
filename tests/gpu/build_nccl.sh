#!/usr/bin/env bash
# Builds NCCL for one GPU architecture from a copy of NVIDIA/nccl's source (its src, makefiles,
# Makefile; NCCL >= 2.30 lets several ranks share a GPU):
#
#   tests/gpu/build_nccl.sh SRC BUILDDIR SM        e.g. ... /tmp/nccl-src /tmp/nccl 90
#
# Only the device functions a single node runs for distmuon and torch.distributed are built:
# every collective over the integer and float types but fp8, with the ring, tree and PAT
# algorithms (NVLink SHARP is off here, NCCL_NVLS_ENABLE=0, and CollNet needs a network plugin),
# and no product reduction. That halves the build (about 100 s on 16 cores) and the library. NCCL
# runs a no-op kernel for a function it was built without, so the GPU verification's
# comparisons with the single process would catch a collective that needed one.
set -euo pipefail
SRC=${1:?SRC} BUILDDIR=${2:?BUILDDIR} SM=${3:?SM}
TYPES="i8|u8|i32|u32|i64|u64|f16|f32|f64|bf16"
FUNCS="(SendRecv|(AllGather|AllGatherV|Broadcast) (RING|PAT) [^ ]*"
FUNCS+="|(AllReduce|Reduce|ReduceScatter) (Sum|MinMax|PreMulSum|SumPostDiv) ($TYPES) (TREE|RING|PAT) [^ ]*)"
# A CUDA toolkit that ships NCCL headers of its own (older ones) shadows some of the source's:
# build against a view of the toolkit without them.
CUDA=${CUDA_HOME:-/usr/local/cuda}
if ls "$CUDA"/include/nccl* > /dev/null 2>&1; then
  view=$(mktemp -d)
  for e in "$CUDA"/*; do [ "$(basename "$e")" = include ] || ln -s "$e" "$view/"; done
  mkdir "$view/include"
  for e in "$CUDA"/include/*; do case "$(basename "$e")" in nccl*) ;; *) ln -s "$e" "$view/include/" ;; esac; done
  CUDA=$view
fi
cd "$SRC"
make -j"$(nproc)" src.build NVCC_GENCODE="-gencode=arch=compute_$SM,code=sm_$SM" BUILDDIR="$BUILDDIR" \
  CUDA_HOME="$CUDA" ONLY_FUNCS="$FUNCS"
