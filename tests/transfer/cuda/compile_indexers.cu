// Compile-only check (make nvcc-check): every generated indexer and fact is valid device code.
#include "kvlayout/engine_kv_format.h"
#include "kvlayout/indexing.cuh"

#include <utility>

template <kvlayout::EngineKVFormat F>
__global__ void locate_kernel(kvlayout::Sizes sizes, std::int64_t block_stride, kvlayout::Coord coord,
                              kvlayout::Location* out) {
  out[0] = kvlayout::Indexer<F>::locate(sizes, block_stride, coord);
  out[1] = kvlayout::locate(F, sizes, block_stride, coord);
  out[2].pointer = kvlayout::kv_size(F) + kvlayout::is_mla(F) + kvlayout::fact_value(kvlayout::format_facts(F), 0);
}

template <int... I>
void instantiate_all(std::integer_sequence<int, I...>) {
  (void)sizeof...(I);
  ((void)&locate_kernel<kvlayout::kAllFormats[I]>, ...);
}

void instantiate() { instantiate_all(std::make_integer_sequence<int, kvlayout::kNumFormats>{}); }
