"""The running app the end-to-end tests share, and the browser they drive."""
import pytest
from app_helpers import free_port


@pytest.fixture(scope="module")
def server(tiny_index):
    import faiss
    import torch

    from app.cli import build_parser, launch

    port = free_port()
    args = build_parser().parse_args(["--index", str(tiny_index), "--port", str(port)])
    from threadpoolctl import ThreadpoolController

    pools = ThreadpoolController()
    threads = torch.get_num_threads(), faiss.omp_get_max_threads(), [c.num_threads for c in pools.lib_controllers]
    demo, svc = launch(args, block=False)  # with the app's default --threads (its share of the cores)
    svc.demo = demo
    yield f"http://127.0.0.1:{port}/", svc, port
    demo.close()
    # the tests after these train models: give them the cores back (torch, FAISS, BLAS, OpenMP)
    torch.set_num_threads(threads[0])
    faiss.omp_set_num_threads(threads[1])
    for c, n in zip(pools.lib_controllers, threads[2], strict=True):
        c.set_num_threads(n)
