//go:build !unix

package bench

// selfCPUSeconds is not measured here: the harness's column reads 0.
func selfCPUSeconds() float64 { return 0 }
