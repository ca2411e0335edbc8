"""pdserve on a Ray cluster: router, prefill and decode workers as detached Ray actors.

Importing this package does not import Ray; ``deploy`` / ``teardown`` / the actors do.
See docs/ray.md.
"""
from pdserve.services.ray_deploy.deploy import DeploymentError, DeploymentInfo, RayDeployment, deploy, describe, teardown

__all__ = ["DeploymentError", "DeploymentInfo", "RayDeployment", "deploy", "describe", "teardown"]
