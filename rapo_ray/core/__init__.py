"""Bottom layer: errors, loopback networking, devices and metric reduction. Imports nothing of rapo_ray."""
