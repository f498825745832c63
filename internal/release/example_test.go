package release_test

import (
	"fmt"

	"github.com/curfew-mesh/curfew/internal/release"
)

func ExampleParseVersion() {
	n, err := release.ParseVersion("v0.2.1")
	fmt.Println(n, err)
	_, err = release.ParseVersion("0.2")
	fmt.Println(err)
	// Output:
	// [0 2 1] <nil>
	// release version "0.2" is not of the form vMAJOR.MINOR.PATCH (e.g. v0.2.0)
}
