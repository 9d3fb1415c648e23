"""The device side of a step: model runner, step inputs, block tables, CUDA graphs, uploads, cascade."""
