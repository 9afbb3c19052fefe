"""Generated from proto/openengine/v1 by orchestrator.openengine.build; do not edit."""
