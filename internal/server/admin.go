package server

import (
	"net/http"

	"github.com/baton-llm/baton/internal/openai"
)

// AdminHandler returns the admin API alone (for its own listener): the worker routes and a 404
// for the rest.
func (s *Server) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	s.admin.Routes(mux, true, s.authed)
	mux.Handle("/", NoRoute())
	return s.observe(mux)
}

// NoRoute answers a request no route of a listener serves (an unknown path, or a method its
// path does not take): 404 in the OpenAI error envelope, naming it.
func NoRoute() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Code: openai.CodeNotFound, Message: noRoute(r)})
	})
}
