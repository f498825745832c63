package service

import "runtime/debug"

// Version is curfew's version. Release builds stamp it (the images' VERSION build
// argument) with
//
//	-ldflags "-X github.com/curfew-mesh/curfew/mesh/service.Version=v0.1.0"
//
// Otherwise it is the main module's version from the build info when the binary was
// built from a module version, else "dev".
var Version = "dev"

// BuildVersion returns Version, or the build info's module version when Version was not
// stamped.
func BuildVersion() string {
	if Version != "dev" {
		return Version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return Version
}
