"""Who was running on each device: Kubernetes pods (kubelet PodResources API) or Slurm jobs."""
