"""fitter.fit: the prediction (memory), the solver, the memory budget, quantization types and the calibration store."""
