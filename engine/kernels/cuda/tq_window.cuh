//! The columns of a TurboQuant row: ws, where the dense window tk starts; bound, where the code blocks end
//! (whole groups of GROUP before the NQ newest columns); tail, whether this is the block of the dense columns.
const int ws = end - tk_shape[2];
const int prev = end - NQ;
const int bound = start + min(prev - start, ((end - start) / GROUP) * GROUP);
const bool tail = s == S - 1;
