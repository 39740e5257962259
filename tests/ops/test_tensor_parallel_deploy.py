"""The two-GPU tensor-parallel worker of compose.yaml: one service, both GPUs, as many ranks as GPUs."""

from .test_deploy import compose, gpu_devices, started_by, worker_services


def test_the_tensor_parallel_worker_is_one_service_on_two_gpus_in_a_profile_of_its_own():
    services = compose()["services"]
    service = worker_services(services)["worker-tp"]
    assert gpu_devices(service) == [{"driver": "nvidia", "device_ids": ["0", "1"], "capabilities": ["gpu"]}]
    environment = service["environment"]
    assert environment["STREAMBATCH_DEVICE"] == "cuda"
    assert int(environment["STREAMBATCH_TENSOR_PARALLEL"]) == len(gpu_devices(service)[0]["device_ids"])
    assert int(service["shm_size"].removesuffix("g")) >= 1, "NCCL between the ranks needs more than Docker's 64 MB"
    assert started_by(services, {"multi-gpu-tp"}) == {"redis", "worker-tp", "gateway"}
    assert all("worker-tp" not in started_by(services, {profile}) for profile in ("cpu", "gpu", "multi-gpu"))
