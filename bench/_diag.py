import sys, json, subprocess
sys.path.insert(0, "tests")
from facecast.shared.cuda_ring import CudaRingProducer
from facecast.shared import messages
p = CudaRingProducer("diag", (64, 96, 3), 4)
d = p.description()
print("handle type", type(p._mem_handle), len(p._mem_handle), type(d.cuda.mem_handle))
open("/tmp/d.msgpack","wb").write(messages.encode(d))
out = subprocess.run([sys.executable, "tests/peers.py", "attach", "--description", "/tmp/d.msgpack", "--device", "cuda"], capture_output=True, text=True)
print(out.stdout[-3000:], out.stderr[-3000:])
