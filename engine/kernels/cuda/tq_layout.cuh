//! The split TurboQuant kernels' lane layout (CPL coordinates a lane on the code path, eight on the dense
//! path) and shared memory.
constexpr int NT = NW * 32;
constexpr int LW = CPL * BITS / 32;   // code words a lane loads per token: 4 = one 16-byte load
constexpr int PER = 32 / BITS;        // codes per word
constexpr int LPT = D / CPL;          // code path: lanes per token
constexpr int TPW = 32 / LPT;
constexpr int TG = NW * TPW;          // tokens per block per load
constexpr int DLPT = D / 8;           // dense path: lanes per token, 8 coordinates each
constexpr int DTPW = 32 / DLPT;
constexpr int DTG = NW * DTPW;
constexpr int E = D >= 32 ? D / 32 : 1;
__shared__ float sc[G][CHUNK];
__shared__ float qs[G][D];
__shared__ float cs[1 << BITS];
__shared__ float red[NW][G][D];
__shared__ float stat[NW][G];
