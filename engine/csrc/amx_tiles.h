// The AMX tile configuration both AMX kernels use: palette 1, eight tiles of 16 rows x 64 bytes.
// Include after defining PD_AMX (the kernels decide it from the compiler's target flags).
#pragma once
#ifdef PD_AMX
#include <cstdint>
#include <immintrin.h>

namespace pd {

struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Loads the configuration on the calling thread (AMX state is per thread).
inline void configure_tiles() {
    TileConfig cfg{};
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

}  // namespace pd
#endif
