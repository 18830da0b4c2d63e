(qs) => qs && qs.startsWith('?') ? window.location.origin + window.location.pathname + qs : qs
