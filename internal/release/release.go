package release

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Dir is where the release images live, relative to the repository root.
const Dir = "proto/releases"

// imageExt is a release image's file extension: buf's binary image format.
const imageExt = ".binpb"

// versionRE is the form of a release's name: v, then MAJOR.MINOR.PATCH without leading
// zeros and without pre-release or build suffixes.
var versionRE = regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$`)

// Image is one release's committed API.
type Image struct {
	// Version is the release's name, e.g. "v0.1.0".
	Version string
	// Path is the image's file, under the repository root given to Images.
	Path string
}

// ParseVersion returns the major, minor and patch numbers of a release name, or an error
// that says what form it must have.
func ParseVersion(v string) ([3]int, error) {
	var n [3]int
	m := versionRE.FindStringSubmatch(v)
	if m == nil {
		return n, fmt.Errorf("release version %q is not of the form vMAJOR.MINOR.PATCH (e.g. v0.2.0)", v)
	}
	for i := range n {
		x, err := strconv.Atoi(m[i+1])
		if err != nil {
			return n, fmt.Errorf("release version %q: %w", v, err)
		}
		n[i] = x
	}
	return n, nil
}

// Images returns the release images committed under repo, oldest first. A file in Dir
// whose name is not a release version is an error, so a typo cannot hide a release.
func Images(repo string) ([]Image, error) {
	entries, err := os.ReadDir(filepath.Join(repo, Dir))
	if err != nil {
		return nil, fmt.Errorf("read release images: %w", err)
	}
	type versioned struct {
		Image
		n [3]int
	}
	var vs []versioned
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, imageExt) {
			return nil, fmt.Errorf("%s/%s: only release images (vX.Y.Z%s) belong here", Dir, name, imageExt)
		}
		v := strings.TrimSuffix(name, imageExt)
		n, err := ParseVersion(v)
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", Dir, name, err)
		}
		vs = append(vs, versioned{Image{Version: v, Path: filepath.Join(repo, Dir, name)}, n})
	}
	slices.SortFunc(vs, func(a, b versioned) int { return slices.Compare(a.n[:], b.n[:]) })
	out := make([]Image, len(vs))
	for i, v := range vs {
		out[i] = v.Image
	}
	return out, nil
}

// Latest returns the newest release image under repo.
func Latest(repo string) (Image, error) {
	imgs, err := Images(repo)
	if err != nil {
		return Image{}, err
	}
	if len(imgs) == 0 {
		return Image{}, fmt.Errorf("no release image in %s", Dir)
	}
	return imgs[len(imgs)-1], nil
}
