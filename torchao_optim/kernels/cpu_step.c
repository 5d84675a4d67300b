/* The fused step on the CPU: one call updates every tensor of a plan, on a few threads.
 *
 * The CPU twin of the Triton kernels (triton_adam.py, triton_momentum.py): the same pointer table (one row per
 * tensor: the parameter, then the codes or fp32 values and the scales of each state), the same coefficient
 * rows, the same codebook and O(1) encoder tables (quant/codec.py), so it stores the codes the compiled path
 * stores for the same values. It knows no format: a state is plain fp32 (kind 0) or codes of 8 or 4 bits
 * (kind 8, kind 4: two per byte, element 2i in the low nibble) in blocks with one fp32 absmax each, or with rank-1
 * scales (a matrix's row and column maxima, StateLayout.scale "rank1": below, "rank-1 scales"), or no codes at all:
 * a factored state (kind 1, StateLayout.scale "factored": a matrix's row and column means, below). A rule
 * carries one, two or three states (as the Triton kernels do: triton_momentum.py one, triton_adam.py two or three).
 *
 * Each quantization block is worked in passes over small buffers that stay in L1: decode the states (and
 * convert a parameter or gradient that is not fp32; fp32 ones are updated where they are); the update rule;
 * store a converted parameter back; take each state's absmax and encode it. Every pass is a plain loop the
 * compiler vectorizes, with hand-written AVX-512 forms where they pay: an 8-bit decode of byte permutes (VBMI) and
 * a 4-bit one of register permutes, no gathers; an encoder of one gather per 16 values where the codebook needs at
 * most a few mantissa bits per exponent (codec.flat_keyed; the built-in ones do), else of two tables, the first from
 * vector registers where the codebook allows. It knows no rule either: each rule's update is
 * C source in the rule's file (rules/<name>.py, FusedRule.c_source), its plain tensor update operation for
 * operation, which kernels/cpu.py puts in at the marker line below ("the update rules") with the table the step
 * calls it through; the build turns off floating-point contraction, so no multiply-add rounds differently from
 * the compiled path.
 *
 * Built on first use with the C compiler torch.compile needs on the CPU anyway (kernels/cpu.py); no build
 * step at install.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define AVX512 1 /* the hand-written vector paths; the plain loops serve every other CPU */
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define VBMI 1 /* byte permutes: the 8-bit decode without gathers */
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
#define AVX2 1 /* without AVX-512: the 4-bit decode's permutes */
#endif

#define MAX_BLOCK 4096
#define MAX_STATES 3 /* a rule's states: one (SGD), two (Adam), three (AdEMAMix, centered RMSprop, amsgrad) */
/* each loop in a function of its own: inlined, its restrict-qualified pointers would stop meaning anything */
#define NOINLINE __attribute__((noinline))

enum { PLAIN = 0, FACTORED = 1, CODES4 = 4, CODES8 = 8 };
enum { F32 = 0, BF16 = 1, F16 = 2 };
/* fp16 parameters need the compiler's _Float16 (GCC 12, recent Clang); without it kernels/cpu.py leaves them to
   the compiled path */
#if defined(__FLT16_MAX__)
#define HAVE_FLOAT16 1
#endif

int torchao_optim_cpu_has_fp16(void) {
#ifdef HAVE_FLOAT16
    return 1;
#else
    return 0;
#endif
}

static inline uint32_t bits_of(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline float float_of(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
static inline int is_finite(float x) { return fabsf(x) < INFINITY; } /* NaN is not < inf */
/* ok ? a : b as bit operations. A state's `s[i] = ok ? s_new : s[i]` written as a select may become a masked store
   where there are no mask registers: AVX2's vmaskmovps, microcoded on AMD's CPUs (Zen 3: Adam's update took 40% of
   the 8-bit step with two of them a vector, against a plain store of the blend) */
static inline float keep_if(int ok, float a, float b) {
    uint32_t mask = -(uint32_t)(ok != 0);
    return float_of((bits_of(a) & mask) | (bits_of(b) & ~mask));
}

/* A one-state rule's update `name` from its inline loop `loop(p, g, s, n, c, option)`, the option a constant in each
   call: a branch on it inside the loop would stop the vectorizer (SGD's nesterov, Muon's) */
#define ONE_STATE_BY_OPTION(name, loop)                                                                               \
    NOINLINE static void name(float *restrict p, const float *restrict g, float *restrict s, int n, const float *c, \
                              int option) {                                                                         \
        if (option) loop(p, g, s, n, c, 1);                                                                         \
        else loop(p, g, s, n, c, 0);                                                                                \
    }

static inline uint32_t mix32(uint32_t x) { /* quant/rounding.py's hash, in uint32 */
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
    return x ^ (x >> 16);
}

/* ---- the parameter and the gradient, to and from fp32 ------------------------------------------------ */
NOINLINE static void load_floats(float *restrict dst, const void *base, int64_t start, int n, int dtype, int negate) {
    float sign = negate ? -1.0f : 1.0f; /* x * -1 is -x exactly, NaN included */
    if (dtype == F32) {
        const float *restrict s = (const float *)base + start;
        for (int i = 0; i < n; i++) dst[i] = s[i] * sign;
    } else if (dtype == BF16) {
        const uint16_t *restrict s = (const uint16_t *)base + start;
        for (int i = 0; i < n; i++) dst[i] = float_of((uint32_t)s[i] << 16) * sign;
    } else {
#ifdef HAVE_FLOAT16
        const _Float16 *restrict s = (const _Float16 *)base + start;
        for (int i = 0; i < n; i++) dst[i] = (float)s[i] * sign;
#endif
    }
}

/* bf16 or fp16 parameters (fp32 ones are updated where they are: run_block) */
NOINLINE static void store_param(const float *restrict p, void *base, int64_t start, int n, int dtype, int sr,
                                 uint32_t key, int64_t offset) {
    if (dtype == BF16 && sr) {
        /* quant/rounding.py: add 16 random bits to the fp32 pattern, keep the top half */
        uint16_t *restrict d = (uint16_t *)base + start;
        uint32_t first = (uint32_t)(offset + start);
        for (int i = 0; i < n; i++) {
            uint32_t noise = mix32(key ^ (first + (uint32_t)i)) >> 16;
            d[i] = (uint16_t)((bits_of(p[i]) + noise) >> 16);
        }
    } else if (dtype == BF16) { /* round to nearest even, as torch converts (NaN: torch's 0x7FC0) */
        uint16_t *restrict d = (uint16_t *)base + start;
        for (int i = 0; i < n; i++) {
            uint32_t b = bits_of(p[i]);
            uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
            d[i] = (uint16_t)(p[i] != p[i] ? 0x7FC0u : rounded);
        }
    } else {
#ifdef HAVE_FLOAT16
        _Float16 *restrict d = (_Float16 *)base + start;
        for (int i = 0; i < n; i++) d[i] = (_Float16)p[i];
#endif
    }
}

/* ---- a state: decode one block, encode it back ------------------------------------------------------- */
/* An 8-bit codebook as four planes of bytes, plane j holding byte j of each value's fp32 pattern: one byte permute
   over two registers looks up 64 codes' byte j at once in 128 entries (AVX-512 VBMI), where a gather loads 16 values
   a lane at a time. Filled for every 8-bit state at the start of a step (make_decoder). */
typedef struct {
    uint8_t planes[4][256];
    /* the interleave of the planes (unpack within 128-bit lanes) leaves register q, lane L, slot k holding position
       16 L + 4 q + k, so the codes are first put in that order: position 16 L + 4 q + k takes code 16 q + 4 L + k */
    uint8_t order[64];
} Decoder8;

static void make_decoder(Decoder8 *D, const float *table) {
    for (int k = 0; k < 256; k++)
        for (int j = 0; j < 4; j++) D->planes[j][k] = (uint8_t)(bits_of(table[k]) >> (8 * j));
    for (int L = 0; L < 4; L++)
        for (int q = 0; q < 4; q++)
            for (int k = 0; k < 4; k++) D->order[16 * L + 4 * q + k] = (uint8_t)(16 * q + 4 * L + k);
}

NOINLINE static void decode8(float *restrict dst, const uint8_t *restrict c, int n, float scale,
                             const float *restrict table, const Decoder8 *restrict D) {
    int i = 0;
#ifdef VBMI
    /* Per 64 codes, put in D->order first: each plane's byte from two permutes (codes 0-127, 128-255) and a blend on
       the code's top bit; then the planes interleaved into fp32 patterns. */
    __m512i plane[4][4];
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 4; h++) plane[j][h] = _mm512_loadu_si512(D->planes[j] + 64 * h);
    const __m512i order = _mm512_loadu_si512(D->order);
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 64 <= n; i += 64) {
        __m512i codes = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(c + i));
        __mmask64 high = _mm512_movepi8_mask(codes);
        __m512i b[4];
        for (int j = 0; j < 4; j++)
            b[j] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(plane[j][0], codes, plane[j][1]),
                                          _mm512_permutex2var_epi8(plane[j][2], codes, plane[j][3]));
        __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
        __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s));
        _mm512_storeu_ps(dst + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s));
        _mm512_storeu_ps(dst + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s));
        _mm512_storeu_ps(dst + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s));
    }
#else
    (void)D;
#endif
    for (; i < n; i++) dst[i] = table[c[i]] * scale;
}

#ifdef AVX2
/* values[idx], idx < 16, from the 16 values in two registers: a permute of each and a blend on the index's bit 3
   (moved to the sign bit, which the blend reads), no gather */
static inline __m256 lookup16(__m256 low, __m256 high, __m256i idx) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx), _mm256_permutevar8x32_ps(high, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
#endif

NOINLINE static void decode4(float *restrict dst, const uint8_t *restrict c, int n, float scale,
                    const float *restrict table) {
    int half = n / 2, j = 0;
#ifdef AVX512
    /* the 16 values (the planner pads a shorter codebook) in one register: a permute per 16 codes, no gather */
    const __m512 values = _mm512_loadu_ps(table), s = _mm512_set1_ps(scale);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (; j + 16 <= half; j += 16) { /* 16 bytes, 32 elements: low nibbles are the even ones */
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + j)));
        __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), values);
        __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
        _mm512_storeu_ps(dst + 2 * j, _mm512_mul_ps(_mm512_permutex2var_ps(even, first, odd), s));
        _mm512_storeu_ps(dst + 2 * j + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, second, odd), s));
    }
#elif defined(AVX2)
    const __m256 low = _mm256_loadu_ps(table), high = _mm256_loadu_ps(table + 8), s = _mm256_set1_ps(scale);
    for (; j + 8 <= half; j += 8) { /* 8 bytes, 16 elements: low nibbles are the even ones */
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + j)));
        __m256i e = _mm256_and_si256(bytes, _mm256_set1_epi32(15)), o = _mm256_srli_epi32(bytes, 4);
        __m256 even = lookup16(low, high, e), odd = lookup16(low, high, o);
        /* interleaved within 128-bit lanes, then the lanes put in order */
        __m256 a = _mm256_mul_ps(_mm256_unpacklo_ps(even, odd), s), b = _mm256_mul_ps(_mm256_unpackhi_ps(even, odd), s);
        _mm256_storeu_ps(dst + 2 * j, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(dst + 2 * j + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
#endif
    for (; j < half; j++) {
        dst[2 * j] = table[c[j] & 15] * scale;
        dst[2 * j + 1] = table[c[j] >> 4] * scale;
    }
    if (n & 1) dst[n - 1] = table[c[half] & 15] * scale;
}

/* codes of 8 or 4 bits (kind) of elements start.. times scale */
static void decode_codes(float *restrict dst, int64_t codes, int64_t start, int n, float scale, int kind,
                         const float *restrict table, const Decoder8 *D) {
    if (kind == CODES8) decode8(dst, (const uint8_t *)codes + start, n, scale, table, D);
    else decode4(dst, (const uint8_t *)codes + start / 2, n, scale, table);
}

static void decode(float *restrict dst, int64_t codes, int64_t scales, int64_t start, int64_t blk, int n, int kind,
                   const float *restrict table, const Decoder8 *D) {
    if (kind == PLAIN) memcpy(dst, (const float *)codes + start, (size_t)n * 4);
    else decode_codes(dst, codes, start, n, ((const float *)scales)[blk], kind, table, D);
}

/* codec.encode: the code of y (fp32 in [-1, 1], no NaN) from two table loads and integer operations */
static inline int32_t encode(float y, const int32_t *restrict level1, const int32_t *restrict level2) {
    /* signed 32-bit indexes throughout: the table loads vectorize to gathers only with those */
    int32_t b = (int32_t)bits_of(y + 0.0f); /* -0.0 + 0.0 is +0.0: -0.0 encodes as 0.0 */
    int32_t top = (b >> 23) & 511;          /* sign and exponent */
    int32_t entry = level1[top];
    int32_t shift = entry & 31;
    int32_t packed = level2[(entry >> 5) + ((b & 0x7FFFFF) >> shift)];
    int32_t low = b & ((1 << shift) - 1);
    int32_t up = (low >= ((packed >> 8) & 0xFFFFFF)) ^ (top >> 8);
    return (packed & 255) + up;
}

/* codec.flat_keyed's encoder, one table load: the code of y from its sign, exponent and top mantissa bits (the
   index) and its mantissa (the key), which carries into the entry's top byte exactly where y passes the bucket's
   boundary. For a codebook with negative values the key's bits are flipped for y < 0 (flip: all ones), whose rows
   the table holds reversed; a codebook without gives every negative y one code and its table's rows as they are
   (flip: 0). */
static inline int32_t encode_flat(float y, const int32_t *restrict table, int shift, uint32_t flip) {
    uint32_t b = bits_of(y + 0.0f); /* -0.0 encodes as 0.0 */
    uint32_t key = (b ^ ((uint32_t)((int32_t)b >> 31) & flip)) & 0x7FFFFFu;
    return (int32_t)(((uint32_t)table[(int32_t)(b >> shift)] + key) >> 24);
}

/* An encoder: codec.flat_keyed's one table where the codebook needs few mantissa bits per exponent (flat_shift > 0:
   kernels/tables.py picks), else codec.BucketTables' two tables, and where the codebook allows, the first table in
   a form that needs no memory load. Exponents 1..96 (magnitudes below 2**-31) of most codebooks are one bucket each,
   all with the same code and no decision boundary: then every exponent is clamped to [96, 127] and its entry
   found among 32 values held in two vector registers per sign (exponent 0, zero and subnormals, may differ:
   never_zero puts a boundary there; it is looked up apart). */
typedef struct {
    const int32_t *level1, *level2;
    int flat_shift; /* > 0: level1 is the one table of codec.flat_keyed, this its shift */
    uint32_t flip;  /* encode_flat's: all ones for a codebook with negative values */
    int compact;
    int32_t by_exponent[2][32]; /* level1 for exponents 96..127, per sign */
    int32_t zero[2];            /* level1 for exponent 0, per sign */
} Encoder;

static void make_encoder(Encoder *E, const int32_t *level1, const int32_t *level2, int flat_shift, int has_negative) {
    E->level1 = level1;
    E->level2 = level2;
    E->flat_shift = flat_shift;
    E->flip = has_negative ? 0xFFFFFFFFu : 0u;
    E->compact = 0;
    if (!level1 || flat_shift > 0) return;
    for (int s = 0; s < 2; s++) {
        const int32_t *l1 = level1 + 256 * s;
        if ((l1[96] & 31) != 23) return;
        for (int e = 1; e < 96; e++)
            if ((l1[e] & 31) != 23 || level2[l1[e] >> 5] != level2[l1[96] >> 5]) return;
        for (int k = 0; k < 32; k++) E->by_exponent[s][k] = l1[96 + k];
        E->zero[s] = l1[0];
    }
    E->compact = 1;
}

#ifdef AVX512
/* encode() on 16 values, with the first table from registers: the same arithmetic, one gather instead of two */
static inline __m512i encode16(__m512 y, const Encoder *E, __m512i pos0, __m512i pos1, __m512i neg0, __m512i neg1,
                               __m512i zero_pos, __m512i zero_neg) {
    const __m512i ones = _mm512_set1_epi32(1);
    __m512i b = _mm512_castps_si512(_mm512_add_ps(y, _mm512_setzero_ps())); /* -0.0 encodes as 0.0 */
    __m512i e = _mm512_and_si512(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(255));
    __m512i k = _mm512_min_epi32(_mm512_sub_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(96)), _mm512_set1_epi32(96)),
                                 _mm512_set1_epi32(31));
    __mmask16 negative = _mm512_cmplt_epi32_mask(b, _mm512_setzero_si512());
    __m512i entry = _mm512_mask_blend_epi32(negative, _mm512_permutex2var_epi32(pos0, k, pos1),
                                            _mm512_permutex2var_epi32(neg0, k, neg1));
    entry = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), entry,
                                    _mm512_mask_blend_epi32(negative, zero_pos, zero_neg));
    __m512i shift = _mm512_and_si512(entry, _mm512_set1_epi32(31));
    __m512i bucket = _mm512_add_epi32(_mm512_srai_epi32(entry, 5),
                                      _mm512_srlv_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFF)), shift));
    __m512i packed = _mm512_i32gather_epi32(bucket, E->level2, 4);
    __m512i low = _mm512_and_si512(b, _mm512_sub_epi32(_mm512_sllv_epi32(ones, shift), ones));
    __mmask16 up = _mm512_cmpge_epi32_mask(low, _mm512_and_si512(_mm512_srli_epi32(packed, 8),
                                                                  _mm512_set1_epi32(0xFFFFFF))) ^ negative;
    __m512i code = _mm512_and_si512(packed, _mm512_set1_epi32(255));
    return _mm512_mask_add_epi32(code, up, code, ones);
}

/* 32 codes (a: elements 0-15, b: 16-31) as 16 bytes, element 2i in the low nibble */
static inline void store_nibbles32(uint8_t *c, __m512i a, __m512i b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512i lo = _mm512_permutex2var_epi32(a, even, b), hi = _mm512_permutex2var_epi32(a, odd, b);
    _mm_storeu_si128((__m128i *)c, _mm512_cvtepi32_epi8(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4))));
}

/* encode_flat() on 16 values */
static inline __m512i encode16_flat(__m512 y, const int32_t *table, __m128i shift, __m512i flip) {
    __m512i b = _mm512_castps_si512(_mm512_add_ps(y, _mm512_setzero_ps()));
    __m512i entry = _mm512_i32gather_epi32(_mm512_srl_epi32(b, shift), table, 4);
    __m512i key = _mm512_and_si512(_mm512_xor_si512(b, _mm512_and_si512(_mm512_srai_epi32(b, 31), flip)),
                                   _mm512_set1_epi32(0x7FFFFF));
    return _mm512_srli_epi32(_mm512_add_epi32(entry, key), 24);
}

#define ENCODER_REGISTERS(E)                                                                                    \
    __m512i pos0 = _mm512_loadu_si512(E->by_exponent[0]), pos1 = _mm512_loadu_si512(E->by_exponent[0] + 16);   \
    __m512i neg0 = _mm512_loadu_si512(E->by_exponent[1]), neg1 = _mm512_loadu_si512(E->by_exponent[1] + 16);   \
    __m512i zero_pos = _mm512_set1_epi32(E->zero[0]), zero_neg = _mm512_set1_epi32(E->zero[1])
#define ENCODE16(y) encode16(y, E, pos0, pos1, neg0, neg1, zero_pos, zero_neg)
#endif

/* The loops over codes are functions of their own: restrict-qualified parameters tell the compiler that
   the byte stores alias none of the inputs, which it needs to vectorize them (as gathers). */
NOINLINE static void encode8_flat(const float *restrict x, uint8_t *restrict c, int n, float inv,
                                  const int32_t *restrict table, int shift, uint32_t flip) {
    int i = 0;
#ifdef AVX512
    const __m512 scale = _mm512_set1_ps(inv);
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m512i flips = _mm512_set1_epi32((int32_t)flip);
    for (; i + 16 <= n; i += 16) {
        __m512i codes = encode16_flat(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale), table, count, flips);
        _mm_storeu_si128((__m128i *)(c + i), _mm512_cvtepi32_epi8(codes));
    }
#endif
    for (; i < n; i++) c[i] = (uint8_t)encode_flat(x[i] * inv, table, shift, flip);
}

NOINLINE static void encode4_flat(const float *restrict x, uint8_t *restrict c, int n, float inv,
                                  const int32_t *restrict table, int shift, uint32_t flip) {
    int half = n / 2, j = 0;
#ifdef AVX512
    const __m512 scale = _mm512_set1_ps(inv);
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m512i flips = _mm512_set1_epi32((int32_t)flip);
    for (; j + 16 <= half; j += 16) /* 32 elements, 16 bytes */
        store_nibbles32(c + j, encode16_flat(_mm512_mul_ps(_mm512_loadu_ps(x + 2 * j), scale), table, count, flips),
                        encode16_flat(_mm512_mul_ps(_mm512_loadu_ps(x + 2 * j + 16), scale), table, count, flips));
#endif
    for (; j < half; j++)
        c[j] = (uint8_t)(encode_flat(x[2 * j] * inv, table, shift, flip) |
                         (encode_flat(x[2 * j + 1] * inv, table, shift, flip) << 4));
    if (n & 1) c[half] = (uint8_t)encode_flat(x[n - 1] * inv, table, shift, flip); /* the high nibble past the end: 0 */
}

NOINLINE static void encode8_tables(const float *restrict x, uint8_t *restrict c, int n, float inv,
                                    const int32_t *restrict level1, const int32_t *restrict level2) {
    for (int i = 0; i < n; i++) c[i] = (uint8_t)encode(x[i] * inv, level1, level2);
}

NOINLINE static void encode4_tables(const float *restrict x, uint8_t *restrict c, int n, float inv,
                                    const int32_t *restrict level1, const int32_t *restrict level2) {
    int half = n / 2;
    for (int j = 0; j < half; j++)
        c[j] = (uint8_t)(encode(x[2 * j] * inv, level1, level2) | (encode(x[2 * j + 1] * inv, level1, level2) << 4));
    if (n & 1) c[half] = (uint8_t)encode(x[n - 1] * inv, level1, level2); /* the high nibble past the end: 0 */
}

/* With the first table in registers where the codebook allows it (AVX-512), then the table loop for the rest */
NOINLINE static void encode8(const float *restrict x, uint8_t *restrict c, int n, float inv, const Encoder *E) {
    if (E->flat_shift > 0) {
        encode8_flat(x, c, n, inv, E->level1, E->flat_shift, E->flip);
        return;
    }
    int i = 0;
#ifdef AVX512
    if (E->compact) {
        ENCODER_REGISTERS(E);
        __m512 scale = _mm512_set1_ps(inv);
        for (; i + 16 <= n; i += 16)
            _mm_storeu_si128((__m128i *)(c + i), _mm512_cvtepi32_epi8(ENCODE16(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale))));
    }
#endif
    encode8_tables(x + i, c + i, n - i, inv, E->level1, E->level2);
}

NOINLINE static void encode4(const float *restrict x, uint8_t *restrict c, int n, float inv, const Encoder *E) {
    if (E->flat_shift > 0) {
        encode4_flat(x, c, n, inv, E->level1, E->flat_shift, E->flip);
        return;
    }
    int half = n / 2, j = 0;
#ifdef AVX512
    if (E->compact) {
        ENCODER_REGISTERS(E);
        __m512 scale = _mm512_set1_ps(inv);
        for (; j + 16 <= half; j += 16) /* 32 elements, 16 bytes */
            store_nibbles32(c + j, ENCODE16(_mm512_mul_ps(_mm512_loadu_ps(x + 2 * j), scale)),
                            ENCODE16(_mm512_mul_ps(_mm512_loadu_ps(x + 2 * j + 16), scale)));
    }
#endif
    encode4_tables(x + 2 * j, c + j, n - 2 * j, inv, E->level1, E->level2);
}

/* x times inv as codes of 8 or 4 bits (kind) of elements start.. */
static void encode_codes(const float *restrict x, int64_t codes, int64_t start, int n, float inv, int kind,
                         const Encoder *E) {
    if (kind == CODES8) encode8(x, (uint8_t *)codes + start, n, inv, E);
    else encode4(x, (uint8_t *)codes + start / 2, n, inv, E);
}

static void encode_store(const float *restrict x, int64_t codes, int64_t scales, int64_t start, int64_t blk, int n,
                         int kind, const Encoder *E) {
    if (kind == PLAIN) {
        memcpy((float *)codes + start, x, (size_t)n * 4);
        return;
    }
    /* the block's absmax: x is finite (the rules skip what would not be), so the largest magnitude is the
       largest pattern with the sign bit cleared, an integer maximum */
    uint32_t top = 0;
    for (int i = 0; i < n; i++) {
        uint32_t m = bits_of(x[i]) & 0x7FFFFFFFu;
        top = m > top ? m : top;
    }
    float absmax = float_of(top);
    float scaled[n < 1 ? 1 : n];
    if (absmax < 0x1p-126f) {
        /* a subnormal absmax's reciprocal overflows: the block and its absmax times 2**64 first (exact), as
           quant/blockwise.normalize does; rare, so out of the vector loops */
        for (int i = 0; i < n; i++) scaled[i] = x[i] * 0x1p64f;
        x = scaled;
        absmax *= 0x1p64f;
    }
    float inv = 1.0f / (absmax > 0.0f ? absmax : 1.0f);
    encode_codes(x, codes, start, n, inv, kind, E);
    absmax = float_of(top);
    ((float *)scales)[blk] = absmax;
}

typedef struct {
    int64_t n_tensors;
    const int64_t *ptrs;       /* (n, 1 + 2 * n_states): param, then (codes or values, scales) per state */
    const int64_t *grad_ptrs;  /* (n,) */
    const int64_t *numels;     /* (n,) */
    const float *coefs;        /* (n, n_coefs) */
    const float *steps;        /* (n,): advanced step counts (stochastic rounding's key) */
    const int64_t *round_info; /* (n, 2): position in the optimizer, element offset */
    const float *values[MAX_STATES]; /* per state: the codebook (decode table) */
    int kinds[MAX_STATES];
    int n_states, n_coefs, block, rule, param_dtype, grad_dtype;
    int option, maximize, sr;  /* option: the rule's (FusedRule.option), passed to its update */
    const int64_t *first_block; /* (n + 1,): prefix sums of blocks per tensor */
    Encoder encoders[MAX_STATES]; /* per state: codec.flat_keyed's table, or codec.BucketTables' level1_by_bits and
                                     level2_with_bounds */
    Decoder8 decoders[MAX_STATES]; /* per 8-bit state: its codebook as byte planes */
    /* rank-1 scales (StateLayout.scale "rank1") and factored states: per state, each tensor's rows of its
       (rows, numel / rows) matrix, or NULL (blockwise: one absmax per block). Where a tensor has rows, a rank-1 state's
       scales are rows row maxima then numel / rows column maxima, and the step's new maxima start at
       stat_offset[k * n_tensors + t] in the array `maxima`; a factored state's pointers are its column means (in
       place of codes) and its row means (in place of scales), and its new sums start there in each range's sums. */
    const int64_t *rows[MAX_STATES];
    int64_t *stat_offset;
    uint32_t *maxima; /* the new maxima, fp32 patterns (non-negative: they order as integers) */
    float *columns;   /* factored states: each one's column means over their mean (col_offset[k * n_tensors + t]) */
    int64_t *col_offset;
} Job;

/* ---- the update rules ---------------------------------------------------------------------------------
   Not written here: each rule's file (rules/<name>.py) holds its element update as C source (FusedRule.c_source),
   and kernels/cpu.py builds this file with the sources of the rules it serves in place of the marker line below,
   each followed by a wrapper of the form update_fn, and the table RULES of them: {name, number of states, number of
   coefficients, wrapper}. The launch passes a rule's index in that table; the step checks its states and
   coefficients against it. A rule's update takes fp32 arrays of n elements and updates them in place: one state,
   (p, g, s, n, c, option); two, (p, g, m, v, n, c, option); three, (p, g, s0, s1, s2, n, c, option); c is the
   tensor's row of coefficients, option the rule's one setting. It may use NOINLINE, is_finite, keep_if
   and ONE_STATE_BY_OPTION above. The wrapper passes the states the rule has: the buffers of the others are never read or
   written. */
typedef void (*update_fn)(const Job *job, float *p, const float *g, float *s0, float *s1, float *s2, int n,
                          const float *c);
/* TORCHAO_OPTIM_RULES */
#define N_RULES ((int)(sizeof(RULES) / sizeof(RULES[0])))

int torchao_optim_cpu_rule_count(void) { return N_RULES; }
const char *torchao_optim_cpu_rule_name(int rule) { return rule >= 0 && rule < N_RULES ? RULES[rule].name : NULL; }
int torchao_optim_cpu_rule_states(int rule) { return rule >= 0 && rule < N_RULES ? RULES[rule].n_states : -1; }
int torchao_optim_cpu_rule_coefs(int rule) { return rule >= 0 && rule < N_RULES ? RULES[rule].n_coefs : -1; }

/* ---- rank-1 scales ------------------------------------------------------------------------------------
   A state whose tensor has rows (Job.rows) is read as a row-major (rows, cols) matrix; element (r, c) has the scale
   min(row maximum r, column maximum c) (state/fourbit.py, FourBitRank1Tensor). Its new maxima are those of the whole
   matrix's new values, so a plan with such a state takes two passes: the first runs the update on copies and keeps
   only each thread's maxima (fold_maxima), the second is the step, which encodes with the merged maxima; the
   maxima are stored last, once no block will decode with the old ones. */
static inline int64_t rank1_rows(const Job *job, int k, int64_t t) { return job->rows[k] ? job->rows[k][t] : 0; }

static inline int is_factored(const Job *job, int k) { return job->kinds[k] == FACTORED; }

static int has_rank1(const Job *job, int64_t t) {
    for (int k = 0; k < job->n_states; k++)
        if (rank1_rows(job, k, t) && !is_factored(job, k)) return 1;
    return 0;
}

/* Each loop below works on one row's piece of a block (a block may end inside a row, or hold several short rows):
   there the row's maximum is one number and the columns' are consecutive, so the loop vectorizes. piece_length: the
   elements of a block's piece that starts at column c, of n left in the block. */
static inline int64_t piece_length(int64_t n, int64_t cols, int64_t c) { return n < cols - c ? n : cols - c; }

/* x times min(row_max, col_max[i]): a decoded piece of a row (torch.minimum of two non-negative numbers) */
NOINLINE static void scale_piece(float *restrict x, int64_t len, float row_max, const float *restrict col_max) {
    for (int64_t i = 0; i < len; i++) {
        float b = col_max[i];
        x[i] = x[i] * (row_max < b ? row_max : b);
    }
}

/* y = x over its scale, as quantize_fields computes it: x * lift * (1 / (scale * lift)) (lift 2**64 for a subnormal
   scale; 1 / 1 for a zero one), NaN as 0, clamped to [-1, 1]; the maxima are fp32 patterns */
NOINLINE static void normalize_piece(const float *restrict x, float *restrict y, int64_t len, float row_max,
                                     const uint32_t *restrict col_max) {
    for (int64_t i = 0; i < len; i++) {
        float b = float_of(col_max[i]);
        float scale = row_max < b ? row_max : b;
        float lift = scale < 0x1p-126f ? 0x1p64f : 1.0f;
        float v = x[i] * lift * (1.0f / (scale > 0.0f ? scale * lift : 1.0f));
        v = v != v ? 0.0f : v;
        y[i] = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
    }
}

/* the maxima of where(isfinite(x), |x|, 0) (as quantize_fields takes them) folded into a row's and its columns', as
   fp32 patterns (non-negative: they order as integers) */
NOINLINE static void fold_piece(const float *restrict x, int64_t len, uint32_t *restrict row_max,
                                uint32_t *restrict col_max) {
    uint32_t top = *row_max;
    for (int64_t i = 0; i < len; i++) {
        uint32_t m = bits_of(x[i]) & 0x7FFFFFFFu;
        m &= -(uint32_t)(m < 0x7F800000u); /* as a mask: with a select GCC does not vectorize the reduction */
        top = m > top ? m : top;
        col_max[i] = m > col_max[i] ? m : col_max[i];
    }
    *row_max = top;
}

/* the decode of a state with rank-1 scales: each code's value (a block of scale 1) times its element's scale, from
   the maxima the state holds */
static void decode_rank1(float *restrict dst, int64_t codes, int64_t scales, int64_t start, int n, int64_t rows,
                         int64_t cols, int kind, const float *restrict table, const Decoder8 *D) {
    decode_codes(dst, codes, start, n, 1.0f, kind, table, D);
    const float *row_max = (const float *)scales, *col_max = row_max + rows;
    for (int64_t r = start / cols, c = start % cols, i = 0, len; i < n; i += len, r++, c = 0) {
        len = piece_length(n - i, cols, c);
        scale_piece(dst + i, len, row_max[r], col_max + c);
    }
}

/* the encode of a state with rank-1 scales, from the new maxima */
static void encode_rank1(const float *restrict x, int64_t codes, int64_t start, int n, int64_t rows, int64_t cols,
                         const uint32_t *restrict maxima, int kind, const Encoder *E) {
    float y[MAX_BLOCK];
    for (int64_t r = start / cols, c = start % cols, i = 0, len; i < n; i += len, r++, c = 0) {
        len = piece_length(n - i, cols, c);
        normalize_piece(x + i, y + i, len, float_of(maxima[r]), maxima + rows + c);
    }
    encode_codes(y, codes, start, n, 1.0f, kind, E);
}

/* the new values' maxima into this thread's (out: rows row maxima, then the column maxima) */
static void fold_maxima(const float *restrict x, int64_t start, int n, int64_t rows, int64_t cols, uint32_t *out) {
    for (int64_t r = start / cols, c = start % cols, i = 0, len; i < n; i += len, r++, c = 0) {
        len = piece_length(n - i, cols, c);
        fold_piece(x + i, len, out + r, out + rows + c);
    }
}

/* ---- factored states ----------------------------------------------------------------------------------
   A factored state (state/factored.py) of a (rows, cols) matrix holds only its row means r and column means c:
   element (i, j) is r[i] * (c[j] / mean(c)), mean(c) the fp64 sum of c over cols rounded to fp32 (0 where it is 0),
   as FactoredState.dequantize computes it; the step makes the columns c[j] / mean(c) once per tensor (Job.columns).
   It writes no codes: its new means are those of the whole matrix's new values (non-finite and negative ones as 0),
   summed in fp64 as each block's update runs (each range its own sums, added in range order after the step) and
   divided by cols or rows once, as FactoredState.quantize_fields takes them; they are stored last. */

/* the columns of a factored matrix over their mean, into out (cols floats) */
static void normalize_columns(const float *restrict col_mean, int64_t cols, float *restrict out) {
    double sum = 0.0;
    for (int64_t j = 0; j < cols; j++) sum += (double)col_mean[j];
    float mean = (float)(sum / (double)cols);
    for (int64_t j = 0; j < cols; j++) out[j] = mean > 0.0f ? col_mean[j] / mean : 0.0f;
}

NOINLINE static void product_piece(float *restrict x, int64_t len, float row, const float *restrict col) {
    for (int64_t i = 0; i < len; i++) x[i] = row * col[i];
}

/* the decode of a factored state: r[i] * columns[j] */
static void decode_factored(float *restrict dst, int64_t scales, int64_t start, int n, int64_t cols,
                            const float *restrict columns) {
    const float *row_mean = (const float *)scales;
    for (int64_t r = start / cols, c = start % cols, i = 0, len; i < n; i += len, r++, c = 0) {
        len = piece_length(n - i, cols, c);
        product_piece(dst + i, len, row_mean[r], columns + c);
    }
}

/* where(isfinite(x) & x > 0, x, 0) in fp64, summed into a row's sum and its columns'. The row's sum is taken in
   SUM_LANES running sums (element i into lane i % SUM_LANES), added in a fixed tree at the end: one running sum
   would chain every addition to the one before (an fp64 add's latency an element) and keep the loop scalar. */
#define SUM_LANES 8
_Static_assert(SUM_LANES == 8, "sum_piece adds its lanes in a tree of eight");
static inline double positive_finite(float v) { return v > 0.0f && v <= 3.40282347e38f ? (double)v : 0.0; }

NOINLINE static void sum_piece(const float *restrict x, int64_t len, double *restrict row_sum,
                               double *restrict col_sum) {
    double lane[SUM_LANES] = {0.0};
    int64_t i = 0;
    for (; i + SUM_LANES <= len; i += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++) {
            double d = positive_finite(x[i + l]); /* NaN and +inf compare false */
            lane[l] += d;
            col_sum[i + l] += d;
        }
    for (int l = 0; i < len; i++, l++) {
        double d = positive_finite(x[i]);
        lane[l] += d;
        col_sum[i] += d;
    }
    *row_sum += ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* the new values' sums into this range's (out: rows row sums, then the column sums) */
static void fold_sums(const float *restrict x, int64_t start, int n, int64_t rows, int64_t cols, double *out) {
    for (int64_t r = start / cols, c = start % cols, i = 0, len; i < n; i += len, r++, c = 0) {
        len = piece_length(n - i, cols, c);
        sum_piece(x + i, len, out + r, out + rows + c);
    }
}

/* ---- one block of one tensor, and a range of blocks --------------------------------------------------- */
/* The block's step; with `stats` (the first pass of a plan with rank-1 scales), the update on copies of the parameter
   and states, whose rank-1 states' new maxima are folded into this thread's `stats`, storing nothing. */
static void run_block(const Job *job, int64_t t, int64_t blk, float *P, float *G, float *S0, float *S1, float *S2,
                      uint32_t *stats, double *sums) {
    const int64_t *row = job->ptrs + t * (1 + 2 * job->n_states);
    int64_t start = blk * job->block, left = job->numels[t] - start;
    int n = left < job->block ? (int)left : job->block;
    float *S[MAX_STATES] = {S0, S1, S2};
    /* fp32 parameters and gradients are updated where they are; other dtypes through the buffers */
    int direct_p = job->param_dtype == F32 && !stats, direct_g = job->grad_dtype == F32 && !job->maximize;
    float *p = direct_p ? (float *)row[0] + start : P;
    const float *g = direct_g ? (const float *)job->grad_ptrs[t] + start : G;
    if (!direct_p) load_floats(P, (const void *)row[0], start, n, job->param_dtype, 0);
    if (!direct_g) load_floats(G, (const void *)job->grad_ptrs[t], start, n, job->grad_dtype, job->maximize);
    for (int k = 0; k < job->n_states; k++) {
        int64_t rows = rank1_rows(job, k, t);
        if (rows && is_factored(job, k))
            decode_factored(S[k], row[2 + 2 * k], start, n, job->numels[t] / rows,
                            job->columns + job->col_offset[k * job->n_tensors + t]);
        else if (rows)
            decode_rank1(S[k], row[1 + 2 * k], row[2 + 2 * k], start, n, rows, job->numels[t] / rows, job->kinds[k],
                         job->values[k], &job->decoders[k]);
        else
            decode(S[k], row[1 + 2 * k], row[2 + 2 * k], start, blk, n, job->kinds[k], job->values[k],
                   &job->decoders[k]);
    }
    const float *c = job->coefs + t * job->n_coefs;
    RULES[job->rule].update(job, p, g, S0, S1, S2, n, c);
    if (stats) {
        for (int k = 0; k < job->n_states; k++) {
            int64_t rows = rank1_rows(job, k, t);
            if (rows && !is_factored(job, k))
                fold_maxima(S[k], start, n, rows, job->numels[t] / rows,
                            stats + job->stat_offset[k * job->n_tensors + t]);
        }
        return;
    }
    if (!direct_p) {
        uint32_t key = 0;
        int64_t offset = 0;
        if (job->sr) { /* quant/rounding.py's rounding_key(position, step) */
            key = mix32(mix32((uint32_t)job->round_info[2 * t]) ^ (uint32_t)(int64_t)job->steps[t]);
            offset = job->round_info[2 * t + 1];
        }
        store_param(P, (void *)row[0], start, n, job->param_dtype, job->sr, key, offset);
    }
    for (int k = 0; k < job->n_states; k++) {
        int64_t rows = rank1_rows(job, k, t);
        if (rows && is_factored(job, k))
            fold_sums(S[k], start, n, rows, job->numels[t] / rows, sums + job->stat_offset[k * job->n_tensors + t]);
        else if (rows)
            encode_rank1(S[k], row[1 + 2 * k], start, n, rows, job->numels[t] / rows,
                         job->maxima + job->stat_offset[k * job->n_tensors + t], job->kinds[k], &job->encoders[k]);
        else
            encode_store(S[k], row[1 + 2 * k], row[2 + 2 * k], start, blk, n, job->kinds[k], &job->encoders[k]);
    }
}

typedef struct {
    const Job *job;
    int64_t lo, hi;  /* global block indexes */
    uint32_t *stats; /* the first pass of a plan with rank-1 scales: this range's maxima; else NULL */
    double *sums;    /* the step of a plan with factored states: this range's sums of their new values */
} Range;

static void *run_range(void *arg) {
    const Range *r = (const Range *)arg;
    const Job *job = r->job;
    float P[MAX_BLOCK], G[MAX_BLOCK], S0[MAX_BLOCK], S1[MAX_BLOCK], S2[MAX_BLOCK]; /* 80 KB of stack */
    int64_t t = 0;
    while (job->first_block[t + 1] <= r->lo) t++; /* the tensor holding block lo */
    for (int64_t b = r->lo; b < r->hi; b++) {
        while (job->first_block[t + 1] <= b) t++;
        if (r->stats && !has_rank1(job, t)) continue; /* the first pass: only tensors with rank-1 scales */
        run_block(job, t, b - job->first_block[t], P, G, S0, S1, S2, r->stats, r->sums);
    }
    return NULL;
}

/* Threads. Torch's own OpenMP team where torch uses one (kernels/cpu.py hands over its GOMP_parallel and thread
   queries): after a parallel torch op (the backward) its threads spin, waiting for more work, and threads of our
   own would compete with them for the cores (measured: twice the step time with OMP_WAIT_POLICY=ACTIVE). Our
   own pthreads otherwise. */
typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_query_t)(void);
static gomp_parallel_t gomp_parallel;
static omp_query_t omp_thread_num, omp_num_threads;

void torchao_optim_cpu_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (gomp_parallel_t)parallel;
    omp_thread_num = (omp_query_t)thread_num;
    omp_num_threads = (omp_query_t)num_threads;
}

typedef struct {
    Range *ranges;
    int n;
} Team;

static void team_member(void *arg) { /* each member takes every team-size-th range: a smaller team still does all */
    const Team *team = (const Team *)arg;
    for (int k = omp_thread_num(); k < team->n; k += omp_num_threads()) run_range(&team->ranges[k]);
}

/* The ranges on `threads` threads (the caller's among them): torch's OpenMP team where there is one, else pthreads. */
static void run_ranges(Range *ranges, int threads, int64_t total) {
    if (threads > 1 && gomp_parallel) {
        Team team = {ranges, threads};
        gomp_parallel(team_member, &team, (unsigned)threads, 0);
        return;
    }
    pthread_t ids[256];
    int started = 0;
    for (int k = 1; k < threads; k++) {
        if (pthread_create(&ids[k], NULL, run_range, &ranges[k]) != 0) break;
        started = k;
    }
    for (int k = started + 1; k < threads; k++) run_range(&ranges[k]); /* threads that did not start */
    if (total > 0) run_range(&ranges[0]);
    for (int k = 1; k <= started; k++) pthread_join(ids[k], NULL);
}

/* One step of every tensor in the table with rule RULES[rule], on up to n_threads threads (the caller's among
   them). Per state: its decode table, encoder tables and kind, the encoder's form (flat: codec.flat_keyed's shift, or
   0), and for rank-1 scales each tensor's rows (NULL: blockwise). Returns 0; -1 for a block size this file does not
   take, -2 where memory runs out, -3 for a rule index, state count or coefficient count that is not the table's. */
int torchao_optim_cpu_step(
    int64_t n_tensors, const int64_t *ptrs, const int64_t *grad_ptrs, const int64_t *numels, const float *coefs,
    const float *steps, const int64_t *round_info,
    const float *values0, const int32_t *level1_0, const int32_t *level2_0, int kind0, int flat0, const int64_t *rows0,
    const float *values1, const int32_t *level1_1, const int32_t *level2_1, int kind1, int flat1, const int64_t *rows1,
    const float *values2, const int32_t *level1_2, const int32_t *level2_2, int kind2, int flat2, const int64_t *rows2,
    int n_states, int n_coefs, int block, int rule, int param_dtype, int grad_dtype,
    int option, int maximize, int sr, int n_threads, int64_t min_blocks_per_thread) {
    if (block <= 0 || block > MAX_BLOCK || (block & 1)) return -1;
    if (rule < 0 || rule >= N_RULES || RULES[rule].n_states != n_states || RULES[rule].n_coefs != n_coefs) return -3;
    int64_t *first_block = (int64_t *)malloc((size_t)(n_tensors + 1) * sizeof(int64_t));
    if (!first_block) return -2;
    first_block[0] = 0;
    for (int64_t t = 0; t < n_tensors; t++) first_block[t + 1] = first_block[t] + (numels[t] + block - 1) / block;
    int64_t total = first_block[n_tensors];
    Job job = {n_tensors, ptrs, grad_ptrs, numels, coefs, steps, round_info,
               {values0, values1, values2}, {kind0, kind1, kind2},
               n_states, n_coefs, block, rule, param_dtype, grad_dtype, option, maximize, sr,
               first_block};
    const int32_t *level1[MAX_STATES] = {level1_0, level1_1, level1_2};
    const int32_t *level2[MAX_STATES] = {level2_0, level2_1, level2_2};
    const int flat[MAX_STATES] = {flat0, flat1, flat2};
    for (int k = 0; k < MAX_STATES; k++) {
        /* only a quantized state's tables are read: a plain state's are placeholders of one element */
        int quantized = k < n_states && job.kinds[k] != PLAIN;
        /* a codebook is sorted: it has negative values where its first is one */
        make_encoder(&job.encoders[k], quantized ? level1[k] : NULL, quantized ? level2[k] : NULL, flat[k],
                     quantized && job.values[k][0] < 0.0f);
        if (quantized && job.kinds[k] == CODES8) make_decoder(&job.decoders[k], job.values[k]);
    }
    const int64_t *rows[MAX_STATES] = {rows0, rows1, rows2};
    /* rank-1 states: the maxima of every such tensor, rows then columns each; factored ones: their sums, so, and their
       normalized columns */
    int64_t n_stats = 0, n_sums = 0, n_columns = 0;
    int status = 0;
    uint32_t *stats = NULL;
    double *sums = NULL;
    for (int k = 0; k < n_states; k++) job.rows[k] = rows[k];
    if (rows0 || rows1 || rows2) {
        job.stat_offset = (int64_t *)malloc((size_t)(n_states * n_tensors) * sizeof(int64_t));
        job.col_offset = (int64_t *)malloc((size_t)(n_states * n_tensors) * sizeof(int64_t));
        if (!job.stat_offset || !job.col_offset) {
            status = -2;
            goto done;
        }
        for (int k = 0; k < n_states; k++)
            for (int64_t t = 0; t < n_tensors; t++) {
                int64_t r = rank1_rows(&job, k, t), size = r ? r + numels[t] / r : 0, *n = &n_stats;
                if (is_factored(&job, k)) {
                    n = &n_sums;
                    job.col_offset[k * n_tensors + t] = n_columns;
                    n_columns += size - r;
                }
                job.stat_offset[k * n_tensors + t] = r ? *n : -1;
                *n += size;
            }
    }
    if (n_columns) {
        job.columns = (float *)malloc((size_t)n_columns * sizeof(float));
        if (!job.columns) {
            status = -2;
            goto done;
        }
        for (int k = 0; k < n_states; k++)
            for (int64_t t = 0; t < n_tensors && is_factored(&job, k); t++) {
                int64_t r = rank1_rows(&job, k, t);
                normalize_columns((const float *)ptrs[t * (1 + 2 * n_states) + 1 + 2 * k], numels[t] / r,
                                  job.columns + job.col_offset[k * n_tensors + t]);
            }
    }
    int64_t useful = min_blocks_per_thread > 0 ? total / min_blocks_per_thread : total;
    int threads = n_threads < 1 ? 1 : n_threads;
    if (threads > useful) threads = useful < 1 ? 1 : (int)useful;
    if (threads > 256) threads = 256;
    Range ranges[256];
    if (n_sums) { /* each range's sums, then their sums in range order */
        sums = (double *)calloc((size_t)((threads + 1) * n_sums), sizeof(double));
        if (!sums) {
            status = -2;
            goto done;
        }
    }
    for (int k = 0; k < threads; k++) {
        ranges[k].job = &job;
        ranges[k].lo = total * k / threads;
        ranges[k].hi = total * (k + 1) / threads;
        ranges[k].stats = NULL;
        ranges[k].sums = sums ? sums + (k + 1) * n_sums : NULL;
    }
    if (n_stats) { /* the first pass: each range's maxima, then their maxima */
        stats = (uint32_t *)calloc((size_t)((threads + 1) * n_stats), sizeof(uint32_t));
        if (!stats) {
            status = -2;
            goto done;
        }
        for (int k = 0; k < threads; k++) ranges[k].stats = stats + (k + 1) * n_stats;
        run_ranges(ranges, threads, total);
        for (int k = 0; k < threads; k++) {
            const uint32_t *part = ranges[k].stats;
            for (int64_t i = 0; i < n_stats; i++) stats[i] = part[i] > stats[i] ? part[i] : stats[i];
            ranges[k].stats = NULL;
        }
        job.maxima = stats;
    }
    run_ranges(ranges, threads, total);
    for (int k = 0; k < threads && n_sums; k++)
        for (int64_t i = 0; i < n_sums; i++) sums[i] += ranges[k].sums[i];
    /* every block has decoded with the old maxima and means: the new ones are the states' now */
    for (int k = 0; k < n_states && (n_stats || n_sums); k++)
        for (int64_t t = 0; t < n_tensors; t++) {
            int64_t r = rank1_rows(&job, k, t), cols = r ? numels[t] / r : 0;
            const int64_t *row = ptrs + t * (1 + 2 * n_states);
            if (!r) continue;
            if (is_factored(&job, k)) { /* the row sums over cols and the column sums over rows, as fp32 means */
                const double *sum = sums + job.stat_offset[k * n_tensors + t];
                float *row_mean = (float *)row[2 + 2 * k], *col_mean = (float *)row[1 + 2 * k];
                for (int64_t i = 0; i < r; i++) row_mean[i] = (float)(sum[i] / (double)cols);
                for (int64_t j = 0; j < cols; j++) col_mean[j] = (float)(sum[r + j] / (double)r);
            } else {
                memcpy((void *)row[2 + 2 * k], stats + job.stat_offset[k * n_tensors + t], (size_t)(r + cols) * 4);
            }
        }
done:
    free(sums);
    free(stats);
    free(job.columns);
    free(job.col_offset);
    free(job.stat_offset);
    free(first_block);
    return status;
}

/* codec.encode over n values (fp32 in [-1, 1], no NaN) through this file's encoders: for testing them. flat_shift > 0:
   level1 is codec.flat_keyed's table, of a codebook with negative values where has_negative. */
void torchao_optim_cpu_encode(const float *y, uint8_t *out, int64_t n, const int32_t *level1, const int32_t *level2,
                              int compact, int flat_shift, int has_negative) {
    Encoder E;
    make_encoder(&E, level1, level2, flat_shift, has_negative);
    E.compact &= compact; /* compact 0: the path of the two table loads */
    for (int64_t i = 0; i < n; i += MAX_BLOCK) {
        int m = n - i < MAX_BLOCK ? (int)(n - i) : MAX_BLOCK;
        encode8(y + i, out + i, m, 1.0f, &E);
    }
}
