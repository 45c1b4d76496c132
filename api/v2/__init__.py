"""The Open Inference Protocol (KServe V2, Triton's HTTP/REST protocol) beside V1.

``protocol.py`` (pydantic bodies), ``tensors.py`` (input tensors -> the same feature columns V1
instances become, so both protocols score identically), ``binary.py`` (the binary tensor data
extension Triton's clients use by default), ``router.py`` (HTTP only).
"""
