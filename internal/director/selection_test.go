package director

import (
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/policy"
)

// Every kind of "no worker" answers one way wherever it is read: its status and code, whether a
// retry may mend it, whether a fallback model may be tried; a wrapped one the same.
func TestNoWorkerKindsAnswerOneWay(t *testing.T) {
	for _, c := range []struct {
		err         *policy.NoWorkerError
		kind        policy.NoWorkerKind
		status      int
		code        string
		final       bool
		fallbackOK  bool
		routeRefuse bool
	}{
		{&policy.NoWorkerError{Role: "regular", Model: "m"}, policy.NoneAvailable, http.StatusServiceUnavailable, openai.CodeNoAvailableWorkers, false, true, false},
		{&policy.NoWorkerError{Role: "regular", Model: "m", Unserved: true}, policy.ModelUnserved, http.StatusNotFound, openai.CodeModelNotFound, false, true, false},
		{&policy.NoWorkerError{Role: "decode", Model: "m", Incompatible: true}, policy.KVIncompatible, http.StatusServiceUnavailable, openai.CodeNoAvailableWorkers, false, true, false},
		{&policy.NoWorkerError{Role: "prefill", Model: "m", Route: "/v1/responses"}, policy.RouteNotDisaggregated, http.StatusNotImplemented, openai.CodeNotImplementedInPD, true, false, true},
		{&policy.NoWorkerError{Role: "regular", Model: "m", Unrouted: "/generate"}, policy.RouteSGLangOnly, http.StatusNotImplemented, openai.CodeRouteNotServed, true, false, true},
	} {
		for _, err := range []error{c.err, fmt.Errorf("choosing: %w", c.err)} {
			if k := c.err.Kind(); k != c.kind || k.RouteRefused() != c.routeRefuse {
				t.Errorf("%v: kind %v (route refused %v), want %v", c.err, k, k.RouteRefused(), c.kind)
			}
			f := SelectionError(err)
			if f.Answer == nil || f.Answer.Status != c.status || f.Answer.Code != c.code || f.Final != c.final {
				t.Errorf("%v: answered %+v (final %v), want %d %s final %v", err, f.Answer, f.Final, c.status, c.code, c.final)
			}
			if fallbackable(err) != c.fallbackOK {
				t.Errorf("%v: fallbackable %v, want %v", err, fallbackable(err), c.fallbackOK)
			}
		}
	}
	if fallbackable(errors.New("something else")) {
		t.Error("an error that is no NoWorkerError is fallbackable")
	}
}
