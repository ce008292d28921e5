# Build targets. `make deb` builds the Debian package (as root on Debian 12: it installs the
# build dependencies with apt) and leaves it in dist/.

BUILD_DEPENDS := debhelper dh-virtualenv devscripts build-essential python3-all python3-dev \
	python3-venv

.PHONY: deb
deb:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
		-o DPkg::Lock::Timeout=300 $(BUILD_DEPENDS)
	dpkg-buildpackage -us -uc -b
	@# dpkg-buildpackage writes the package and its .buildinfo and .changes to the parent
	@# directory; move this version's files into dist/.
	mkdir -p dist
	set -e; \
	  name="logbroker_$$(dpkg-parsechangelog -S Version)_$$(dpkg-architecture -qDEB_HOST_ARCH)"; \
	  mv ../$$name.deb ../$$name.buildinfo ../$$name.changes dist/; \
	  echo "built dist/$$name.deb"
