"""lp_runner's CPU kernels: linear layers prepacked for the native product or oneDNN, the native attention and
whole Llama-family decoder layers in C, the packed-weight arena, the custom ops that let a compiled graph call
them, and the sharing of cores between groups of one node.
"""
