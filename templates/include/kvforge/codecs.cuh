// Coding schemes of keys and values: decode-time scoring / loading and encode-time packing,
// one header per scheme under codecs/ (each mirrors a codec folder of
// crates/kvforge-spec/src/codecs/). The byte layout (array offsets) comes from kvforge-spec's
// SegmentLayout through the generated TierDef; numerics follow each codec's f64 reference.
#pragma once
#include "kvforge/codecs/base.cuh"
#include "kvforge/codecs/drop.cuh"
#include "kvforge/codecs/dense.cuh"
#include "kvforge/codecs/int.cuh"
#include "kvforge/codecs/spherical.cuh"
#include "kvforge/codecs/mixed.cuh"
#include "kvforge/codecs/rotated.cuh"
