package outcome

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestTable(t *testing.T) {
	for _, tc := range []struct {
		status int
		err    error
		want   Verdict
	}{
		{200, nil, Verdict{Sample: true}},
		{400, nil, Verdict{Sample: true}},
		{404, nil, Verdict{Sample: true}},
		{408, nil, Verdict{Retryable: true, Sample: true, Failure: true, Reason: "status_408"}},
		{0, ErrKeyRefused, Verdict{Retryable: true, Sample: true, Failure: true, Reason: "key_refused"}},
		{401, nil, Verdict{Sample: true}},
		{429, nil, Verdict{Retryable: true, Reason: "status_429"}},
		{500, nil, Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "status_500"}},
		{501, nil, Verdict{Sample: true, Seam: true}},
		{502, nil, Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "status_502"}},
		{503, nil, Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "status_503"}},
		{504, nil, Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "status_504"}},
		{0, context.Canceled, Verdict{Client: true}},
		{0, fmt.Errorf("read: %w", context.Canceled), Verdict{Client: true}},
		{0, context.DeadlineExceeded, Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "timeout"}},
		{0, fmt.Errorf("dial: %w", ErrRequestTimeout), Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "timeout"}},
		{0, io.ErrUnexpectedEOF, Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "transport"}},
		{200, errors.New("connection reset"), Verdict{Retryable: true, Sample: true, Failure: true, Seam: true, Reason: "transport"}},
	} {
		if diff := cmp.Diff(tc.want, Of(tc.status, tc.err)); diff != "" {
			t.Errorf("Of(%d, %v) (-want +got):\n%s", tc.status, tc.err, diff)
		}
	}
}

// Medium 9: Baton's own descriptor exhaustion was counted against the worker it was dialling
// (and opened its circuit for a minute after the attack ended). Local resource errors are
// Baton's: no sample, no retry.
func TestLocalErrorsAreNotTheWorkers(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.EADDRNOTAVAIL, syscall.ENOBUFS} {
		err := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", errno)}
		if v := Err(fmt.Errorf("upstream: %w", err)); v.Sample || v.Failure || v.Retryable || v.Reason != "local" {
			t.Errorf("%v: %+v", errno, v)
		}
	}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	if v := Err(refused); !v.Failure || !v.Retryable {
		t.Errorf("connection refused is the worker's: %+v", v)
	}
}
