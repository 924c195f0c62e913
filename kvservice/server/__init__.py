"""The gRPC allocator service: servicer (translation only), auth, leases, metrics and the app."""
