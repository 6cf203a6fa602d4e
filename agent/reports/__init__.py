"""Read-side reports over the archive for planners: capacity and published peaks."""
