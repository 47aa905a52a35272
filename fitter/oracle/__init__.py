"""fitter.oracle: llama.cpp's own dry run in a child process, its log parser, the check against the prediction and calibrate's measurement."""
